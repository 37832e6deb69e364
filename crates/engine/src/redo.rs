//! Writes of several keys of one sled tree that land whole or not at all, without
//! `apply_batch`.
//!
//! Why not `apply_batch`: sled 0.34 has one lock for the whole process (`concurrency_control`),
//! taken shared by every other operation — a read, an insert, an iterator step, and a flush for
//! as long as its `fsync` runs — and exclusively by `apply_batch`. A batch waits for every
//! holder to let go, and while it waits every new operation of the process waits behind it: the
//! body reads of rendering, the log's own readers.
//! Under `anima-load` on the embedded log, group commits whose `apply_batch` took 80–118 ms (the
//! flush after it a few ms) came with bursts where every call took 100–250 ms.
//!
//! How instead: the whole write set is inserted first as one redo record under `redo_key` (one
//! insert, atomic), then applied key by key with plain inserts and removals (which take the lock
//! shared), then the redo record is removed. sled recovers a prefix of its operations after a
//! crash (one operation log for every tree of a database), so the trees then hold either none of
//! the writes (the redo record never landed), or the redo record with a prefix of the writes,
//! which [`complete`] applies again, whole, before anything reads the tree; or all of them. The
//! writes are inserts and removals of whole values, so applying one twice is the same as once.
//! (Checkpoints were written the same way while they lived in sled; their store now has atomic
//! batches of its own, `checkpoint.rs`. The embedded log's group commits too, while each record
//! came with a msg-id entry; its layout 4 writes only records, in seq order, through
//! [`write_in_order`], and still completes at open what an older build left torn.)
//!
//! The redo record goes in a tree of its own (`redo_tree`): in the written tree, it shares a
//! leaf with the keys beside it, and every change to that leaf before its removal rewrote it
//! with the record inside. The embedded log's append bench (`embedded_append`, groups of 1,000
//! records of ~300 B) gave 34,837 ev/s against raw sled's 154,276 (ratio 0.23) with the record in
//! the log's tree, and 125,046 against 157,278 (0.80) in its own, where the `apply_batch` build
//! gave 150,878 against 184,570 (0.82).

/// A write set: keys with their new value, or `None` to remove the key, applied in this order.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Writes(Vec<(Vec<u8>, Option<Vec<u8>>)>);

impl Writes {
    pub fn insert(&mut self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) {
        self.0.push((key.into(), Some(value.into())));
    }

    pub fn remove(&mut self, key: impl Into<Vec<u8>>) {
        self.0.push((key.into(), None));
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Writes `writes` into `tree` whole, through a redo record in `redo_tree` (see the module
/// documentation); not flushed. Nothing writes this way any more: it stays for the tests that
/// leave a redo record as older builds of the embedded log did. `tear_after`:
/// for tests of a crash, stop after the redo record and that many writes and return `Ok(false)`,
/// leaving the redo record, as a crash would. `Ok(true)`: written whole.
#[cfg(test)]
pub fn write(
    tree: &sled::Tree,
    redo_tree: &sled::Tree,
    redo_key: &[u8],
    writes: &Writes,
    tear_after: Option<usize>,
) -> sled::Result<bool> {
    let redo = postcard::to_stdvec(writes).expect("a write set encodes");
    redo_tree.insert(redo_key, redo)?;
    let applied = tear_after.unwrap_or(usize::MAX);
    apply(tree, writes, applied)?;
    if applied < writes.len() {
        return Ok(false);
    }
    redo_tree.remove(redo_key)?;
    Ok(true)
}

/// Writes `writes` into `tree` in order, with plain inserts and removals and no redo record;
/// not flushed. For a write set every prefix of which is a state the tree may be left in (the
/// embedded log's records in seq order): sled recovers a prefix of its operations after a crash
/// (above). `tear_after`: for tests of a crash, stop after that many writes and return
/// `Ok(false)`. `Ok(true)`: written whole.
pub fn write_in_order(tree: &sled::Tree, writes: &Writes, tear_after: Option<usize>) -> sled::Result<bool> {
    let applied = tear_after.unwrap_or(usize::MAX);
    apply(tree, writes, applied)?;
    Ok(applied >= writes.len())
}

fn apply(tree: &sled::Tree, writes: &Writes, max: usize) -> sled::Result<()> {
    for (key, value) in writes.0.iter().take(max) {
        match value {
            Some(value) => drop(tree.insert(key.as_slice(), value.as_slice())?),
            None => drop(tree.remove(key.as_slice())?),
        }
    }
    Ok(())
}

/// Completes the write a crash interrupted, if `redo_tree` holds its redo record under `redo_key`,
/// and flushes: the number of writes applied again, or `None` when there was none. `Err` with a
/// message when the redo record does not decode (nothing is changed then).
pub fn complete(tree: &sled::Tree, redo_tree: &sled::Tree, redo_key: &[u8]) -> Result<Option<usize>, String> {
    let Some(redo) = redo_tree.get(redo_key).map_err(|e| e.to_string())? else {
        return Ok(None);
    };
    let writes: Writes = postcard::from_bytes(&redo)
        .map_err(|e| format!("the redo record of an interrupted write does not decode: {e}"))?;
    apply(tree, &writes, usize::MAX).map_err(|e| e.to_string())?;
    redo_tree.remove(redo_key).map_err(|e| e.to_string())?;
    tree.flush().map_err(|e| e.to_string())?;
    Ok(Some(writes.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const REDO: &[u8] = b"x:redo";

    /// A written tree and a redo tree of one database.
    fn trees() -> (tempfile::TempDir, sled::Tree, sled::Tree) {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::Config::new().path(dir.path()).open().unwrap();
        (dir, db.open_tree("t").unwrap(), db.open_tree("redo").unwrap())
    }

    fn contents(tree: &sled::Tree) -> Vec<(Vec<u8>, Vec<u8>)> {
        tree.iter().map(|entry| entry.unwrap()).map(|(k, v)| (k.to_vec(), v.to_vec())).collect()
    }

    fn writes() -> Writes {
        let mut writes = Writes::default();
        writes.insert(b"a".to_vec(), b"1".to_vec());
        writes.insert(b"b".to_vec(), b"2".to_vec());
        writes.remove(b"old".to_vec());
        writes.insert(b"c".to_vec(), b"3".to_vec());
        writes
    }

    /// A write torn after any number of its keys is completed whole by the next `complete`, and
    /// a tree whole again has no redo record and nothing to complete.
    #[test]
    fn a_torn_write_is_completed_whole() {
        let (_whole_dir, whole, whole_redo) = trees();
        whole.insert(b"old", b"x".as_slice()).unwrap();
        assert!(write(&whole, &whole_redo, REDO, &writes(), None).unwrap());
        assert!(whole_redo.is_empty());
        let expected = contents(&whole);
        assert_eq!(expected.len(), 3, "a, b and c; old removed: {expected:?}");
        for torn_after in 0..4 {
            let (_dir, tree, redo) = trees();
            tree.insert(b"old", b"x".as_slice()).unwrap();
            assert!(!write(&tree, &redo, REDO, &writes(), Some(torn_after)).unwrap());
            assert_ne!(contents(&tree), expected, "torn after {torn_after}");
            assert_eq!(complete(&tree, &redo, REDO).unwrap(), Some(4));
            assert_eq!(contents(&tree), expected, "completed after a tear after {torn_after}");
            assert!(redo.is_empty());
            assert_eq!(complete(&tree, &redo, REDO).unwrap(), None);
        }
    }

    /// A redo record that does not decode is reported and leaves the tree as it was.
    #[test]
    fn a_redo_record_that_does_not_decode_is_reported() {
        let (_dir, tree, redo) = trees();
        redo.insert(REDO, b"\xff\xff\xff".as_slice()).unwrap();
        let error = complete(&tree, &redo, REDO).unwrap_err();
        assert!(error.contains("does not decode"), "{error}");
        assert!(redo.get(REDO).unwrap().is_some());
        assert!(tree.is_empty());
    }
}
