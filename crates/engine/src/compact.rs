//! Rewriting a stopped engine's data dir into a new, compact one: `anima-wake compact`.
//!
//! sled 0.34 appends every write to its file and reuses a segment of it only after rewriting
//! what is still live there; under steady checkpoint traffic that falls far behind, and the
//! file never shrinks but from its tail. After 90 s of `anima-load` on JetStream the data dir
//! held 110 MiB of entries in a 1,724 MiB file. Every tree copied in key order into a fresh
//! database took 383 MiB (README, "What a data dir holds"). This is the offline remedy an
//! operator can use today: the engine does not bound the file while it runs.
//!
//! Checkpoints now live in a store of their own (`crate::checkpoint`) that keeps its files near
//! what it holds while the engine runs; the copy rewrites them too, so the new data dir is whole.
//!
//! The copy is written beside the target (`NEW.partial`), checked against the source (sled's
//! checksum of every tree's keys and values must be equal, and so must a digest of every
//! checkpoint's), flushed and closed, and only then renamed to the target: a target that exists
//! is a whole, checked copy. The source is opened (so locked) for the whole copy and never
//! written.

use std::path::{Path, PathBuf};

use crate::data_dir::{self, DataDirError};
use crate::store_census::Tally;

/// Entries per sled batch of the copy. Batches of this size wrote a 110 MiB checkpoint tree
/// into 383 MiB, against 494 MiB for one insert per entry (and about 1.4 times as long).
const COPY_BATCH_ENTRIES: usize = 10_000;
/// sled's page cache for each side of the copy: entries are read and written once, in order.
const COPY_CACHE_BYTES: u64 = 64 * 1024 * 1024;
/// Progress is reported every this many entries of a tree.
const PROGRESS_EVERY_ENTRIES: u64 = 100_000;

/// What a compaction did: the sizes on disk before and after, and what each tree holds.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Compaction {
    pub before_bytes: u64,
    pub after_bytes: u64,
    /// Every tree of the source (name, its entries and their bytes), empty ones included.
    pub trees: Vec<(String, Tally)>,
}

impl Compaction {
    pub fn entries(&self) -> u64 {
        self.trees.iter().map(|(_, tally)| tally.entries).sum()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    #[error("no data dir at {0} (no sled database in it)")]
    Missing(String),
    #[error("{0} already exists: compact writes a new data dir (pick a path that does not exist)")]
    TargetExists(String),
    #[error("{0} is the data dir itself: compact writes a new data dir beside it")]
    SameDir(String),
    #[error(transparent)]
    DataDir(#[from] DataDirError),
    #[error("{what} {path}: {source}")]
    Store {
        what: &'static str,
        path: String,
        #[source]
        source: sled::Error,
    },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The checkpoint store could not be read or written.
    #[error("{what} the checkpoints of {path}: {reason}")]
    Checkpoints { what: &'static str, path: String, reason: String },
    /// The copy's checksum differs from the source's: the copy was removed.
    #[error("the copy of {0} does not match it (checksums differ); nothing was written")]
    Mismatch(String),
}

/// Copies every tree of the data dir `from` (which no running engine may hold) into a new data
/// dir `into`, which must not exist. `progress(tree, entries)` is called while a tree is
/// copied. On any error nothing is left at `into`.
pub fn compact(from: &Path, into: &Path, mut progress: impl FnMut(&str, u64)) -> Result<Compaction, CompactError> {
    if !from.join("db").is_file() {
        return Err(CompactError::Missing(from.display().to_string()));
    }
    if into.symlink_metadata().is_ok() {
        return Err(CompactError::TargetExists(into.display().to_string()));
    }
    if same_dir(from, into) {
        return Err(CompactError::SameDir(into.display().to_string()));
    }
    let partial = partial_path(into);
    // A partial copy is what an earlier compaction left when it was stopped: never a data dir.
    remove_dir_if_present(&partial)?;
    let source = data_dir::open(from, COPY_CACHE_BYTES, false)?;
    let copied = copy_checked(&source, from, &partial, &mut progress)
        .and_then(|mut trees| {
            trees.extend(copy_checkpoints(from, &partial, &mut progress)?);
            Ok(trees)
        })
        .and_then(|trees| {
            let before_bytes = data_dir::bytes_on_disk(from).map_err(io("sizing", from))?;
            let after_bytes = data_dir::bytes_on_disk(&partial).map_err(io("sizing", &partial))?;
            Ok(Compaction { before_bytes, after_bytes, trees })
        });
    drop(source);
    let released = data_dir::wait_until_released(from, data_dir::RELEASE_WAIT_DEFAULT);
    let compaction = match copied.and_then(|compaction| released.map(|()| compaction).map_err(CompactError::from)) {
        Ok(compaction) => compaction,
        Err(e) => {
            remove_dir_if_present(&partial)?;
            return Err(e);
        }
    };
    std::fs::rename(&partial, into).map_err(io("renaming the copy to", into))?;
    Ok(compaction)
}

/// The copy of `source` into a new database at `partial`, checked, flushed and closed: each
/// tree's tally.
fn copy_checked(
    source: &sled::Db,
    from: &Path,
    partial: &Path,
    progress: &mut impl FnMut(&str, u64),
) -> Result<Vec<(String, Tally)>, CompactError> {
    let target = data_dir::open(partial, COPY_CACHE_BYTES, true)?;
    let mut trees = Vec::new();
    for name in source.tree_names() {
        let label = String::from_utf8_lossy(&name).into_owned();
        let from_tree = source.open_tree(&name).map_err(store("reading", from))?;
        let into_tree = target.open_tree(&name).map_err(store("writing", partial))?;
        let mut tally = Tally::default();
        let mut batch = sled::Batch::default();
        let mut in_batch = 0;
        for entry in from_tree.iter() {
            let (key, value) = entry.map_err(store("reading", from))?;
            tally.add(&key, &value);
            batch.insert(key, value);
            in_batch += 1;
            if in_batch == COPY_BATCH_ENTRIES {
                into_tree.apply_batch(std::mem::take(&mut batch)).map_err(store("writing", partial))?;
                in_batch = 0;
            }
            if tally.entries % PROGRESS_EVERY_ENTRIES == 0 {
                progress(&label, tally.entries);
            }
        }
        into_tree.apply_batch(batch).map_err(store("writing", partial))?;
        progress(&label, tally.entries);
        trees.push((label, tally));
    }
    let same =
        source.checksum().map_err(store("checking", from))? == target.checksum().map_err(store("checking", partial))?;
    target.flush().map_err(store("writing", partial))?;
    data_dir::close(target, partial, data_dir::RELEASE_WAIT_DEFAULT)?;
    if !same {
        return Err(CompactError::Mismatch(from.display().to_string()));
    }
    Ok(trees)
}

/// The copy of every checkpoint of `from`'s checkpoint store into a new one at `partial`, each
/// checked against its source by a digest of its entries, read back from the copy: each
/// checkpoint's tally. Nothing when `from` has no checkpoint store.
fn copy_checkpoints(
    from: &Path,
    partial: &Path,
    progress: &mut impl FnMut(&str, u64),
) -> Result<Vec<(String, Tally)>, CompactError> {
    use crate::checkpoint::CheckpointDb;
    use sha2::Digest as _;
    if !CheckpointDb::exists(from) {
        return Ok(Vec::new());
    }
    let failed = |what: &'static str, path: &Path| {
        let path = path.display().to_string();
        move |e: &dyn std::fmt::Display| CompactError::Checkpoints { what, path: path.clone(), reason: e.to_string() }
    };
    let (reading, writing) = (failed("reading", from), failed("writing", partial));
    let source = CheckpointDb::open(from, COPY_CACHE_BYTES).map_err(|e| reading(&e))?;
    let target = CheckpointDb::open(partial, COPY_CACHE_BYTES).map_err(|e| writing(&e))?;
    let mut trees = Vec::new();
    for name in source.names() {
        let Some(from_tree) = source.existing(&name).map_err(|e| reading(&e))? else { continue };
        let into_tree = target.keyspace(&name).map_err(|e| writing(&e))?;
        let mut tally = Tally::default();
        let mut digest = sha2::Sha256::new();
        for entry in from_tree.iter() {
            let (key, value) = entry.into_inner().map_err(|e| reading(&e))?;
            tally.add(&key, &value);
            digest_entry(&mut digest, &key, &value);
            into_tree.insert(key, value).map_err(|e| writing(&e))?;
            if tally.entries % PROGRESS_EVERY_ENTRIES == 0 {
                progress(&name, tally.entries);
            }
        }
        progress(&name, tally.entries);
        let mut copied = sha2::Sha256::new();
        for entry in into_tree.iter() {
            let (key, value) = entry.into_inner().map_err(|e| writing(&e))?;
            digest_entry(&mut copied, &key, &value);
        }
        if digest.finalize() != copied.finalize() {
            return Err(CompactError::Mismatch(from.display().to_string()));
        }
        trees.push((name, tally));
    }
    target.persist().map_err(|e| writing(&e))?;
    Ok(trees)
}

/// Feeds one entry to a checkpoint's digest, lengths first so that entries cannot run together.
fn digest_entry(digest: &mut sha2::Sha256, key: &[u8], value: &[u8]) {
    use sha2::Digest as _;
    digest.update((key.len() as u64).to_be_bytes());
    digest.update(key);
    digest.update((value.len() as u64).to_be_bytes());
    digest.update(value);
}

/// Where the copy is written until it is whole and checked: `NEW.partial`, beside `NEW`.
pub fn partial_path(into: &Path) -> PathBuf {
    let mut name = into.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".partial");
    into.with_file_name(name)
}

/// Whether `into` would land inside `from` or be it (the copy must sit beside the source).
fn same_dir(from: &Path, into: &Path) -> bool {
    let (Ok(from), Some(parent)) = (from.canonicalize(), into.parent()) else { return false };
    let parent = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
    parent.canonicalize().is_ok_and(|parent| parent.starts_with(&from))
}

fn remove_dir_if_present(dir: &Path) -> Result<(), CompactError> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(CompactError::Io { what: "removing", path: dir.display().to_string(), source }),
    }
}

fn store<'a>(what: &'static str, path: &'a Path) -> impl Fn(sled::Error) -> CompactError + 'a {
    move |source| CompactError::Store { what, path: path.display().to_string(), source }
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl Fn(std::io::Error) -> CompactError + 'a {
    move |source| CompactError::Io { what, path: path.display().to_string(), source }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A data dir with two trees and garbage in its file: values written over and over and
    /// keys removed, as checkpoints leave it.
    /// A tree's name and its entries, in key order.
    type TreeEntries = (Vec<u8>, anima_projections::cold::Entries);

    fn churned(dir: &Path) -> Vec<TreeEntries> {
        let churn = |insert: &mut dyn FnMut(u32, Vec<u8>), remove: &mut dyn FnMut(u32)| {
            for round in 0..20u32 {
                for i in 0..3_000u32 {
                    insert(i, vec![(round % 251) as u8; 200]);
                }
                for i in (0..3_000u32).step_by(3) {
                    remove(i);
                }
            }
        };
        let db = data_dir::open(dir, COPY_CACHE_BYTES, true).unwrap();
        let tree = db.open_tree("log").unwrap();
        churn(&mut |i, value| drop(tree.insert(i.to_be_bytes(), value).unwrap()), &mut |i| {
            drop(tree.remove(i.to_be_bytes()).unwrap())
        });
        let log = tree.iter().map(|e| e.unwrap()).map(|(k, v)| (k.to_vec(), v.to_vec())).collect();
        db.insert(b"default-key", b"default-value").unwrap();
        drop(tree);
        data_dir::close(db, dir, data_dir::RELEASE_WAIT_DEFAULT).unwrap();
        let store = crate::checkpoint::CheckpointDb::open(dir, COPY_CACHE_BYTES).unwrap();
        let tree = store.keyspace("checkpoint-embedded").unwrap();
        churn(&mut |i, value| tree.insert(i.to_be_bytes(), value).unwrap(), &mut |i| {
            tree.remove(i.to_be_bytes()).unwrap()
        });
        store.persist().unwrap();
        let checkpoint = checkpoint_entries(&tree);
        vec![(b"log".to_vec(), log), (b"checkpoint-embedded".to_vec(), checkpoint)]
    }

    fn checkpoint_entries(tree: &fjall::Keyspace) -> anima_projections::cold::Entries {
        tree.iter().map(|e| e.into_inner().unwrap()).map(|(k, v)| (k.to_vec(), v.to_vec())).collect()
    }

    #[test]
    fn the_copy_holds_every_entry_and_takes_less_room() {
        let root = tempfile::tempdir().unwrap();
        let (from, into) = (root.path().join("data"), root.path().join("data-compact"));
        let expected = churned(&from);
        let mut reported = Vec::new();
        let compaction = compact(&from, &into, |tree, entries| reported.push((tree.to_owned(), entries))).unwrap();
        assert!(
            compaction.after_bytes < compaction.before_bytes,
            "{} bytes after, {} before",
            compaction.after_bytes,
            compaction.before_bytes
        );
        assert_eq!(compaction.entries(), 1 + 2 * 2_000, "{:?}", compaction.trees);
        assert!(reported.iter().any(|(tree, entries)| tree == "log" && *entries == 2_000), "{reported:?}");
        assert!(!partial_path(&into).exists(), "the partial copy was renamed");
        let copy = data_dir::open(&into, COPY_CACHE_BYTES, false).unwrap();
        let log = copy.open_tree("log").unwrap();
        let copied: Vec<_> = log.iter().map(|e| e.unwrap()).map(|(k, v)| (k.to_vec(), v.to_vec())).collect();
        assert_eq!(copied, expected[0].1, "the log tree");
        assert_eq!(copy.get(b"default-key").unwrap().as_deref(), Some(&b"default-value"[..]));
        drop((log, copy));
        let copied_store = crate::checkpoint::CheckpointDb::open(&into, COPY_CACHE_BYTES).unwrap();
        let checkpoint = copied_store.existing("checkpoint-embedded").unwrap().expect("the checkpoint was copied");
        assert_eq!(checkpoint_entries(&checkpoint), expected[1].1, "the checkpoint");
        drop((checkpoint, copied_store));
        data_dir::wait_until_released(&into, data_dir::RELEASE_WAIT_DEFAULT).unwrap();
        // The source is untouched and free again.
        let source = data_dir::open(&from, COPY_CACHE_BYTES, false).unwrap();
        assert_eq!(source.open_tree("log").unwrap().len(), 2_000);
    }

    #[test]
    fn refuses_what_it_cannot_do_and_leaves_nothing_behind() {
        let root = tempfile::tempdir().unwrap();
        let (from, into) = (root.path().join("data"), root.path().join("data-compact"));
        let missing = compact(&root.path().join("nothing"), &into, |_, _| {}).unwrap_err();
        assert!(matches!(missing, CompactError::Missing(_)), "{missing}");
        churned(&from);
        std::fs::create_dir(&into).unwrap();
        let exists = compact(&from, &into, |_, _| {}).unwrap_err();
        assert!(matches!(exists, CompactError::TargetExists(_)), "{exists}");
        std::fs::remove_dir(&into).unwrap();
        let inside = compact(&from, &from.join("copy"), |_, _| {}).unwrap_err();
        assert!(matches!(inside, CompactError::SameDir(_)), "{inside}");
        // A dir in use (a server running on it) is refused, and no partial copy stays.
        let running = data_dir::open(&from, COPY_CACHE_BYTES, false).unwrap();
        let locked = compact(&from, &into, |_, _| {}).unwrap_err();
        assert!(matches!(locked, CompactError::DataDir(DataDirError::Locked { .. })), "{locked}");
        drop(running);
        data_dir::wait_until_released(&from, data_dir::RELEASE_WAIT_DEFAULT).unwrap();
        assert!(!into.exists() && !partial_path(&into).exists());
        // What an interrupted compaction left is discarded, not taken for a data dir.
        std::fs::create_dir(partial_path(&into)).unwrap();
        std::fs::write(partial_path(&into).join("db"), b"half").unwrap();
        compact(&from, &into, |_, _| {}).unwrap();
        assert!(into.join("db").is_file() && !partial_path(&into).exists());
    }
}
