//! What a data dir holds against what it takes on disk: `anima-wake store-stats`.
//!
//! sled 0.34 appends every write to its segment file and reclaims a segment only once at most
//! half of it is live, by rewriting its live pages as other writes go on; nothing shrinks the
//! file but the tail becoming free. Under steady checkpoint traffic the file grew far past what
//! the store held (README, "Where the memory goes"), which is why checkpoints moved to a store of
//! their own (`crate::checkpoint`). This census reads every entry of both stores once (keys and
//! values, as stored) and groups them by tree (a sled tree, or a checkpoint) and, in a
//! checkpoint, by table, so an operator can see how much of the data dir is live and which
//! table holds it.

use std::collections::BTreeMap;
use std::path::Path;

use anima_projections::slot_page;
use anima_projections::state::State;

use crate::checkpoint::{ANALYTICS_PREFIX, STATE_PREFIX};
use crate::data_dir::{self, DataDirError};

/// sled's page cache while the census reads: every entry is read once, so a cache buys nothing.
const CENSUS_CACHE_BYTES: u64 = 16 * 1024 * 1024;

/// Entries and their stored bytes (key plus value).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub entries: u64,
    pub bytes: u64,
}

impl Tally {
    pub(crate) fn add(&mut self, key: &[u8], value: &[u8]) {
        self.entries += 1;
        self.bytes += (key.len() + value.len()) as u64;
    }
}

/// One sled tree: its total and its groups (tables of a checkpoint tree, by name).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TreeCensus {
    pub name: String,
    pub total: Tally,
    pub groups: BTreeMap<String, Tally>,
}

/// A data dir: the size of its files and what each tree holds.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StoreCensus {
    pub on_disk_bytes: u64,
    pub trees: Vec<TreeCensus>,
}

impl StoreCensus {
    /// Stored bytes of every tree.
    pub fn live_bytes(&self) -> u64 {
        self.trees.iter().map(|tree| tree.total.bytes).sum()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CensusError {
    #[error("no data dir at {0} (no sled database in it)")]
    Missing(String),
    #[error(transparent)]
    DataDir(#[from] DataDirError),
    #[error("reading data dir {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: sled::Error,
    },
    #[error("reading the checkpoints of data dir {path}: {reason}")]
    Checkpoints { path: String, reason: String },
    #[error("sizing data dir {path}: {source}")]
    Size {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Reads every entry of the data dir at `dir`, which no running engine may hold (sled's lock
/// says so: [`DataDirError::Locked`]).
pub fn census(dir: &Path) -> Result<StoreCensus, CensusError> {
    if !dir.join("db").is_file() {
        return Err(CensusError::Missing(dir.display().to_string()));
    }
    let db = data_dir::open(dir, CENSUS_CACHE_BYTES, false)?;
    let read_error = |source| CensusError::Read { path: dir.display().to_string(), source };
    let mut trees = Vec::new();
    for name in db.tree_names() {
        let tree = db.open_tree(&name).map_err(read_error)?;
        let name = String::from_utf8_lossy(&name).into_owned();
        let checkpoint = name.starts_with(crate::checkpoint::CHECKPOINT_TREE_PREFIX);
        let mut census = TreeCensus { name, ..TreeCensus::default() };
        for entry in tree.iter() {
            let (key, value) = entry.map_err(read_error)?;
            census.total.add(&key, &value);
            if checkpoint {
                census.groups.entry(checkpoint_group(&key)).or_default().add(&key, &value);
            }
        }
        if census.total.entries > 0 {
            trees.push(census);
        }
    }
    if crate::checkpoint::CheckpointDb::exists(dir) {
        let checkpoints_error = |e: &dyn std::fmt::Display| CensusError::Checkpoints {
            path: dir.display().to_string(),
            reason: e.to_string(),
        };
        let store =
            crate::checkpoint::CheckpointDb::open(dir, CENSUS_CACHE_BYTES).map_err(|e| checkpoints_error(&e))?;
        for name in store.names() {
            let Some(tree) = store.existing(&name).map_err(|e| checkpoints_error(&e))? else { continue };
            let mut census = TreeCensus { name, ..TreeCensus::default() };
            for entry in tree.iter() {
                let (key, value) = entry.into_inner().map_err(|e| checkpoints_error(&e))?;
                census.total.add(&key, &value);
                census.groups.entry(checkpoint_group(&key)).or_default().add(&key, &value);
            }
            if census.total.entries > 0 {
                trees.push(census);
            }
        }
    }
    drop(db);
    data_dir::wait_until_released(dir, data_dir::RELEASE_WAIT_DEFAULT)?;
    let on_disk_bytes =
        data_dir::bytes_on_disk(dir).map_err(|source| CensusError::Size { path: dir.display().to_string(), source })?;
    Ok(StoreCensus { on_disk_bytes, trees })
}

/// The group of a checkpoint tree's key: the state table it belongs to (its pages counted with
/// it), the maintained analytics, or the checkpoint's own metadata.
fn checkpoint_group(key: &[u8]) -> String {
    match key {
        [STATE_PREFIX, tag, ..] => {
            let (table_tag, paged) =
                if slot_page::is_page_tag(*tag) { (tag & !slot_page::PAGE_TAG_BIT, true) } else { (*tag, false) };
            let table = State::table_of_tag(table_tag).map_or_else(|| format!("tag {table_tag}"), str::to_owned);
            if paged {
                format!("{table} (pages)")
            } else {
                table
            }
        }
        [ANALYTICS_PREFIX, ..] => "analytics".to_owned(),
        _ => "checkpoint metadata".to_owned(),
    }
}

/// The census as the command prints it: the file against what it holds, then each tree and its
/// tables, largest first.
pub fn render(dir: &Path, census: &StoreCensus) -> String {
    use std::fmt::Write as _;
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    let live = census.live_bytes();
    let mut out = String::new();
    let share = if census.on_disk_bytes == 0 { 0.0 } else { 100.0 * live as f64 / census.on_disk_bytes as f64 };
    let _ = writeln!(
        out,
        "data dir {}: {:.1} MiB on disk, {:.1} MiB of entries (keys and values) in it ({share:.1}% live)",
        dir.display(),
        mib(census.on_disk_bytes),
        mib(live),
    );
    for tree in &census.trees {
        let _ = writeln!(out, "  tree {}: {} entries, {:.1} MiB", tree.name, tree.total.entries, mib(tree.total.bytes));
        let mut groups: Vec<_> = tree.groups.iter().collect();
        groups.sort_by(|a, b| b.1.bytes.cmp(&a.1.bytes).then_with(|| a.0.cmp(b.0)));
        for (group, tally) in groups {
            let _ = writeln!(out, "    {group:<28} {:>12} entries {:>10.1} MiB", tally.entries, mib(tally.bytes));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint tree's entries are grouped by the table their tag names, slot pages counted
    /// with their table, and the tree's total is every entry's key and value; the log tree is
    /// counted whole.
    #[test]
    fn entries_are_counted_by_tree_and_table() {
        let dir = tempfile::tempdir().unwrap();
        let tag_of = |table| (0..=u8::MAX).find(|tag| State::table_of_tag(*tag) == Some(table)).expect("a table's tag");
        let (identities, rows) = (tag_of("identities"), tag_of("journal_rows"));
        assert!(slot_page::is_page_tag(rows | slot_page::PAGE_TAG_BIT), "journal rows are paged");
        {
            let db = data_dir::open(dir.path(), CENSUS_CACHE_BYTES, true).unwrap();
            let log = db.open_tree("log").unwrap();
            for seq in 0u64..5 {
                log.insert(seq.to_be_bytes(), vec![7u8; 100]).unwrap();
            }
            drop(log);
            data_dir::close(db, dir.path(), data_dir::RELEASE_WAIT_DEFAULT).unwrap();
            let store = crate::checkpoint::CheckpointDb::open(dir.path(), CENSUS_CACHE_BYTES).unwrap();
            let checkpoint = store.keyspace(crate::checkpoint::EMBEDDED_CHECKPOINT_TREE).unwrap();
            checkpoint.insert([STATE_PREFIX, identities, 1], vec![0u8; 10]).unwrap();
            checkpoint.insert([STATE_PREFIX, identities, 2], vec![0u8; 20]).unwrap();
            checkpoint.insert([STATE_PREFIX, rows | slot_page::PAGE_TAG_BIT, 1], vec![0u8; 30]).unwrap();
            checkpoint.insert([ANALYTICS_PREFIX, 1], vec![0u8; 4]).unwrap();
            checkpoint.insert(crate::checkpoint::FOLD_VERSION_KEY, vec![0u8; 4]).unwrap();
            store.persist().unwrap();
        }
        let census = census(dir.path()).unwrap();
        let log = census.trees.iter().find(|tree| tree.name == "log").expect("the log tree");
        assert_eq!(log.total, Tally { entries: 5, bytes: 5 * (8 + 100) });
        assert!(log.groups.is_empty());
        let checkpoint = census.trees.iter().find(|tree| tree.name.ends_with("embedded")).expect("the checkpoint");
        assert_eq!(checkpoint.groups["identities"], Tally { entries: 2, bytes: 3 + 10 + 3 + 20 });
        assert_eq!(checkpoint.groups["journal_rows (pages)"], Tally { entries: 1, bytes: 3 + 30 });
        assert_eq!(checkpoint.groups["analytics"], Tally { entries: 1, bytes: 2 + 4 });
        assert_eq!(checkpoint.groups["checkpoint metadata"].entries, 1);
        assert_eq!(checkpoint.total.entries, 5);
        assert!(census.on_disk_bytes > 0);
        let text = render(dir.path(), &census);
        assert!(text.contains("journal_rows (pages)"), "{text}");
        // The dir was let go: an engine can open it right after.
        data_dir::open(dir.path(), CENSUS_CACHE_BYTES, false).unwrap();
    }

    #[test]
    fn a_dir_without_a_store_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let error = census(&dir.path().join("nothing")).unwrap_err();
        assert!(matches!(error, CensusError::Missing(_)), "{error}");
        assert!(error.to_string().contains("nothing"), "{error}");
    }
}
