//! The data directory: one sled database holding the embedded log (when it is the backend), and
//! the checkpoint store in its own folder (`crate::checkpoint`). This module owns how the sled
//! database is opened (with an explicit page-cache bound) and how a caller knows the directory
//! was really let go.
//!
//! Both stores lock their files (the checkpoint store its `checkpoints/lock`) the same way.
//! sled locks its directory (an exclusive `flock` on the `db` file) so that one process at a time
//! uses it. The lock goes away only when sled closes that file, which its own background threads
//! may do a moment *after* the last `Db` handle is dropped. Reopening the directory right away —
//! a restart in a test, the replay tool after a server stopped, a simulated crash — then fails
//! with "could not acquire lock … WouldBlock" on a loaded machine. [`wait_until_released`] ends
//! that race: it waits, with a deadline, until the lock can be taken, so "closed" means closed.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fs2::FileExt;

/// sled's page cache when nothing else is configured. sled's own default is 1 GiB, which alone
/// would exceed a small engine's whole memory budget.
pub const SLED_CACHE_BYTES_DEFAULT: u64 = 128 * 1024 * 1024;
/// How long a close waits for sled to let go of the directory before it reports a leak.
pub const RELEASE_WAIT_DEFAULT: Duration = Duration::from_secs(30);
/// How often the release wait looks at the lock again.
const RELEASE_POLL: Duration = Duration::from_millis(5);

/// Errors of opening or closing a data dir.
#[derive(Debug, thiserror::Error)]
pub enum DataDirError {
    /// Another process (or a handle this process still holds) has the directory. Stop it, or
    /// point this one at another directory.
    #[error("data dir {path} is in use (another anima-wake, or a handle not yet closed)")]
    Locked { path: String },
    /// The directory could not be created or read; fix permissions or the path.
    #[error("opening data dir {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// sled refused the database (corrupt, or written by an incompatible version).
    #[error("opening data dir {path}: {source}")]
    Store {
        path: String,
        #[source]
        source: sled::Error,
    },
    /// Every handle was dropped but the lock was still held after the deadline: a handle leaked
    /// somewhere in this process. A bug; restarting the process frees the directory.
    #[error("data dir {path} still locked {waited:?} after it was closed")]
    NotReleased { path: String, waited: Duration },
}

/// The files whose locks mark the directory as in use: sled's, then the checkpoint store's.
fn lock_files(dir: &Path) -> [PathBuf; 2] {
    [dir.join("db"), dir.join(crate::checkpoint::CHECKPOINT_DIR).join("lock")]
}

/// What every file under `dir` (both stores) takes on disk, in bytes: the blocks allocated to
/// it, as `du` counts them. Not the files' lengths: the checkpoint store makes each journal
/// 64 MiB long before writing it, and only what it wrote takes room.
pub fn bytes_on_disk(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt as _;
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            total += bytes_on_disk(&entry.path())?;
        } else if kind.is_file() {
            total += entry.metadata()?.blocks() * 512;
        }
    }
    Ok(total)
}

/// What a cached page takes in memory against the size sled counts it by. sled bounds its
/// cache by the size of each page's on-disk fragments, while in memory a page is a node of
/// separately allocated keys and values plus its copy-on-write versions. Measured under
/// `anima-load` (heaptrack of the engine at ~1M events, glibc's allocator): sled held 238 MiB
/// with `cache_capacity` at 32 MiB and 424 MiB at 128 MiB, so 1.94 bytes of memory per byte
/// it counted, beside ~176 MiB that no cache setting bounds (see [`open`]).
pub const SLED_MEMORY_PER_COUNTED_BYTE: u64 = 2;

/// Opens (creating it when `create`) the sled database of `dir` whose page cache takes about
/// `cache_bytes` of memory: sled is told [`SLED_MEMORY_PER_COUNTED_BYTE`] times less, since it
/// counts pages by their size on disk. What no cache bound covers is sled's bookkeeping of
/// every page it ever paged out (a leaf holds at most 16 entries, so a store of millions of
/// small entries has hundreds of thousands of pages): it grows with the store.
pub fn open(dir: &Path, cache_bytes: u64, create: bool) -> Result<sled::Db, DataDirError> {
    let path = dir.display().to_string();
    if create {
        std::fs::create_dir_all(dir).map_err(|source| DataDirError::Open { path: path.clone(), source })?;
    }
    let counted_bytes = cache_bytes / SLED_MEMORY_PER_COUNTED_BYTE;
    sled::Config::new().path(dir).cache_capacity(counted_bytes).open().map_err(|source| {
        // sled reports its directory lock as an IO error of kind Other whose text names the lock.
        if source.to_string().contains("could not acquire lock") {
            DataDirError::Locked { path }
        } else {
            DataDirError::Store { path, source }
        }
    })
}

/// Flushes `db` and drops it, then waits until sled has let go of the directory (see the module
/// docs). Every other handle on the same database (trees of the log and of the checkpoints) must
/// already be dropped, or this waits until `timeout` and says so.
pub fn close(db: sled::Db, dir: &Path, timeout: Duration) -> Result<(), DataDirError> {
    if let Err(source) = db.flush() {
        return Err(DataDirError::Store { path: dir.display().to_string(), source });
    }
    drop(db);
    wait_until_released(dir, timeout)
}

/// Waits until no handle (in this process or another) holds a lock of the stores of `dir`, for
/// at most `timeout`. A store that is not there counts as released.
pub fn wait_until_released(dir: &Path, timeout: Duration) -> Result<(), DataDirError> {
    let started = Instant::now();
    for path in lock_files(dir) {
        wait_for_lock(dir, &path, started, timeout)?;
    }
    Ok(())
}

fn wait_for_lock(dir: &Path, path: &Path, started: Instant, timeout: Duration) -> Result<(), DataDirError> {
    loop {
        let file = match std::fs::OpenOptions::new().read(true).write(true).open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(source) => return Err(DataDirError::Open { path: dir.display().to_string(), source }),
        };
        // `flock` locks belong to the open file description, so this probe conflicts with
        // sled's own lock even inside the same process.
        if file.try_lock_exclusive().is_ok() {
            // Dropping the file releases the probe's lock at once.
            let _ = FileExt::unlock(&file);
            return Ok(());
        }
        if started.elapsed() >= timeout {
            return Err(DataDirError::NotReleased { path: dir.display().to_string(), waited: started.elapsed() });
        }
        std::thread::sleep(RELEASE_POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_data_dir_opens_again_at_once() {
        let dir = tempfile::tempdir().unwrap();
        for round in 0..20u32 {
            let db = open(dir.path(), 1024 * 1024, true).unwrap();
            db.insert(round.to_be_bytes(), &b"x"[..]).unwrap();
            close(db, dir.path(), RELEASE_WAIT_DEFAULT).unwrap();
        }
        let db = open(dir.path(), 1024 * 1024, false).unwrap();
        assert_eq!(db.len(), 20, "every round's write survived its close");
    }

    #[test]
    fn an_open_data_dir_is_locked_and_the_wait_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let db = open(dir.path(), 1024 * 1024, true).unwrap();
        assert!(matches!(open(dir.path(), 1024 * 1024, false), Err(DataDirError::Locked { .. })));
        let waited = wait_until_released(dir.path(), Duration::from_millis(50));
        assert!(matches!(waited, Err(DataDirError::NotReleased { .. })), "{waited:?}");
        drop(db);
        wait_until_released(dir.path(), RELEASE_WAIT_DEFAULT).unwrap();
    }
}
