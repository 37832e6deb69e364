//! Hashed maps and sets for the fold's hot tables.
//!
//! The hasher has a fixed seed, so a fold hashes the same on every run and machine and the
//! deterministic simulation stays deterministic. Nothing persisted or compared reads a hashed
//! table in its hash order: the canonical encoding and the checkpoint sort what they take.
//! Keys are ids that authenticated connectors send; a fixed seed does not resist keys chosen to
//! collide, which costs such a sender time, never a wrong verdict.

use std::collections::{HashMap, HashSet};

/// The hasher of every hashed table of the fold.
pub type Hasher = foldhash::fast::FixedState;

pub type HashedMap<K, V> = HashMap<K, V, Hasher>;

pub type HashedSet<K> = HashSet<K, Hasher>;
