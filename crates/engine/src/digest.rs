//! The memory digest: a SHA-256 over an agent's `MEMORY.md` and `notes/` tree that
//! a runtime takes before and after a memory pass, so the outcome (`completed` when it changed,
//! `quiet_skipped` when not) is decided from what really changed. Runtimes may reimplement it;
//! the format below is the contract, and `anima-wake digest DIR` is the reference.
//!
//! # Format (`anima-memory-digest-v1`)
//!
//! ```text
//! digest  = SHA-256( field("anima-memory-digest-v1") || record* )
//! field(b) = u64 big-endian length of b || b
//! record  = kind (1 byte) || field(path) || payload
//!
//! kind 1  missing file        no payload         (MEMORY.md absent)
//! kind 2  missing directory   no payload         (notes absent)
//! kind 3  regular file        field(content)
//! kind 4  directory           no payload         (for notes/, its entries follow as records)
//! kind 5  symbolic link       field(target)      (the link text; never followed)
//! kind 6  other               no payload         (socket, FIFO, device)
//! ```
//!
//! `path` is relative to the agent directory, components joined by `/`, names as raw bytes
//! (on Unix; on Windows the WTF-8 of the name). Records come in this order: `MEMORY.md`, then
//! `notes`, then the `notes/` tree depth first, the entries of each directory sorted by the
//! bytes of their names (`notes/a`, `notes/a/x`, `notes/a.md`, `notes/b`).
//!
//! Only names, kinds, link texts and file bytes enter the digest: modification times,
//! permissions and owners do not, so touching a file leaves it unchanged. Nothing outside
//! `MEMORY.md` and `notes/` is read. A `MEMORY.md` that is a directory is recorded as a
//! directory without its contents (the memory is a file); a `notes` that is a file is recorded
//! with its bytes.
//!
//! The walk is bounded ([`MemoryDigestLimits`]) and fails rather than hash a tree it cannot
//! read completely: a runtime then reports the pass as failed, never as quiet.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::Path;

use sha2::{Digest, Sha256};

/// Version tag hashed first. A different encoding must use a different tag.
pub const MEMORY_DIGEST_VERSION_TAG: &str = "anima-memory-digest-v1";
/// The memory file at the top of the agent directory.
pub const MEMORY_FILE_NAME: &str = "MEMORY.md";
/// The notes tree at the top of the agent directory.
pub const NOTES_DIR_NAME: &str = "notes";

/// Deepest entry below `notes/`, in path components (`notes/a/b.md` has depth 2). Notes are
/// organised by hand or by an agent; anything deeper is a runaway loop (a directory created in
/// itself), not a memory.
pub const DIGEST_DEPTH_MAX: usize = 32;
/// Records in one digest (`MEMORY.md`, `notes` and every entry below it). Bounds the names held
/// in memory and the time of a walk.
pub const DIGEST_ENTRIES_MAX: usize = 100_000;
/// File contents and link texts read in one digest. A memory read into a model's context is
/// kilobytes to megabytes; the bound stops a runtime from hashing a dumped dataset for minutes
/// before and after every pass.
pub const DIGEST_BYTES_MAX: u64 = 256 * 1024 * 1024;

const KIND_MISSING_FILE: u8 = 1;
const KIND_MISSING_DIRECTORY: u8 = 2;
const KIND_REGULAR_FILE: u8 = 3;
const KIND_DIRECTORY: u8 = 4;
const KIND_SYMLINK: u8 = 5;
const KIND_OTHER: u8 = 6;

/// Bounds of one walk. [`Default`] gives the documented constants; tests and tools may lower
/// them. Runtimes must use the defaults so that their digests fail where the engine's would.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryDigestLimits {
    pub depth_max: usize,
    pub entries_max: usize,
    pub bytes_max: u64,
}

impl Default for MemoryDigestLimits {
    fn default() -> Self {
        MemoryDigestLimits { depth_max: DIGEST_DEPTH_MAX, entries_max: DIGEST_ENTRIES_MAX, bytes_max: DIGEST_BYTES_MAX }
    }
}

/// Why a digest could not be taken, beyond plain IO errors. Carried inside the returned
/// [`io::Error`] (kind `Other`); [`MemoryDigestError::of`] gets it back.
#[derive(Debug, thiserror::Error)]
pub enum MemoryDigestError {
    /// An entry lies deeper below `notes/` than the limit. Report the pass as failed; someone
    /// has to prune the tree.
    #[error("{path}: nested deeper below notes/ than the limit of {depth_max}")]
    DepthExceeded { path: String, depth_max: usize },
    /// More entries than the limit. Report the pass as failed; the tree needs pruning.
    #[error("{path}: more than {entries_max} entries in MEMORY.md and notes/")]
    EntriesExceeded { path: String, entries_max: usize },
    /// More file bytes than the limit. Report the pass as failed; the memory is too large.
    #[error("{path}: more than {bytes_max} bytes in MEMORY.md and notes/")]
    BytesExceeded { path: String, bytes_max: u64 },
    /// An entry changed while it was read (vanished, was replaced, or its length changed).
    /// Retry once whoever writes the directory has finished.
    #[error("{path}: changed while the digest was taken")]
    ChangedDuringWalk { path: String },
}

impl MemoryDigestError {
    /// The digest error inside an error returned by [`memory_digest`], if it is one.
    pub fn of(error: &io::Error) -> Option<&MemoryDigestError> {
        error.get_ref().and_then(|inner| inner.downcast_ref::<MemoryDigestError>())
    }
}

impl From<MemoryDigestError> for io::Error {
    fn from(error: MemoryDigestError) -> io::Error {
        io::Error::other(error)
    }
}

/// The digest of `dir/MEMORY.md` and `dir/notes/` with the default limits. `dir` itself must be
/// a directory (a symlink to one is followed; nothing below it is).
pub fn memory_digest(dir: &Path) -> io::Result<[u8; 32]> {
    memory_digest_with_limits(dir, MemoryDigestLimits::default())
}

/// [`memory_digest`] as lowercase hex (64 characters), as runtimes send it in `Wakes.Finish`.
pub fn memory_digest_hex(dir: &Path) -> io::Result<String> {
    memory_digest(dir).map(|digest| digest_hex(&digest))
}

/// Lowercase hex of a digest.
pub fn digest_hex(digest: &[u8; 32]) -> String {
    hex::encode(digest)
}

/// [`memory_digest`] with other bounds.
pub fn memory_digest_with_limits(dir: &Path, limits: MemoryDigestLimits) -> io::Result<[u8; 32]> {
    let root = fs::metadata(dir).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dir.display())))?;
    if !root.is_dir() {
        return Err(io::Error::new(io::ErrorKind::NotADirectory, format!("{}: not a directory", dir.display())));
    }
    let mut walk = DigestWalk { hasher: Sha256::new(), limits, entries: 0, bytes: 0 };
    walk.field(MEMORY_DIGEST_VERSION_TAG.as_bytes());
    walk.top_level(dir, MEMORY_FILE_NAME, KIND_MISSING_FILE)?;
    walk.top_level(dir, NOTES_DIR_NAME, KIND_MISSING_DIRECTORY)?;
    Ok(walk.hasher.finalize().into())
}

struct DigestWalk {
    hasher: Sha256,
    limits: MemoryDigestLimits,
    entries: usize,
    bytes: u64,
}

impl DigestWalk {
    fn field(&mut self, bytes: &[u8]) {
        self.hasher.update((bytes.len() as u64).to_be_bytes());
        self.hasher.update(bytes);
    }

    fn record_head(&mut self, kind: u8, relative: &[u8]) {
        self.hasher.update([kind]);
        self.field(relative);
    }

    fn count_entry(&mut self, relative: &[u8]) -> io::Result<()> {
        self.entries += 1;
        if self.entries > self.limits.entries_max {
            let path = display(relative);
            return Err(MemoryDigestError::EntriesExceeded { path, entries_max: self.limits.entries_max }.into());
        }
        Ok(())
    }

    fn count_bytes(&mut self, relative: &[u8], len: u64) -> io::Result<()> {
        self.bytes = self.bytes.saturating_add(len);
        if self.bytes > self.limits.bytes_max {
            let path = display(relative);
            return Err(MemoryDigestError::BytesExceeded { path, bytes_max: self.limits.bytes_max }.into());
        }
        Ok(())
    }

    /// `MEMORY.md` or `notes`: absence is a record of its own.
    fn top_level(&mut self, dir: &Path, name: &str, missing_kind: u8) -> io::Result<()> {
        let path = dir.join(name);
        let relative = name.as_bytes();
        match fs::symlink_metadata(&path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.count_entry(relative)?;
                self.record_head(missing_kind, relative);
                Ok(())
            }
            Err(e) => Err(with_path(e, &path)),
            Ok(metadata) => {
                // Only the notes tree is descended into.
                let descend = missing_kind == KIND_MISSING_DIRECTORY;
                self.entry(&path, relative, &metadata, descend, 0)
            }
        }
    }

    fn entry(
        &mut self,
        path: &Path,
        relative: &[u8],
        metadata: &fs::Metadata,
        descend: bool,
        depth: usize,
    ) -> io::Result<()> {
        self.count_entry(relative)?;
        let file_type = metadata.file_type();
        if file_type.is_symlink() {
            let target = fs::read_link(path).map_err(|e| changed_if_gone(e, path, relative))?;
            let target = target.as_os_str().as_encoded_bytes();
            self.count_bytes(relative, target.len() as u64)?;
            self.record_head(KIND_SYMLINK, relative);
            self.field(target);
        } else if file_type.is_file() {
            self.regular_file(path, relative, metadata)?;
        } else if file_type.is_dir() {
            self.record_head(KIND_DIRECTORY, relative);
            if descend {
                self.directory(path, relative, depth)?;
            }
        } else {
            self.record_head(KIND_OTHER, relative);
        }
        Ok(())
    }

    fn regular_file(&mut self, path: &Path, relative: &[u8], listed: &fs::Metadata) -> io::Result<()> {
        let mut file = File::open(path).map_err(|e| changed_if_gone(e, path, relative))?;
        let opened = file.metadata().map_err(|e| with_path(e, path))?;
        // `open` follows links: make sure it opened the regular file that was listed.
        if !opened.is_file() || !same_file(listed, &opened) {
            return Err(changed(relative));
        }
        let len = opened.len();
        self.count_bytes(relative, len)?;
        self.record_head(KIND_REGULAR_FILE, relative);
        self.hasher.update(len.to_be_bytes());
        let copied =
            io::copy(&mut (&mut file).take(len), &mut HashWriter(&mut self.hasher)).map_err(|e| with_path(e, path))?;
        let mut probe = [0u8; 1];
        if copied != len || file.read(&mut probe).map_err(|e| with_path(e, path))? != 0 {
            return Err(changed(relative));
        }
        Ok(())
    }

    /// The entries of a directory of the notes tree at `depth` (notes itself is 0).
    fn directory(&mut self, path: &Path, relative: &[u8], depth: usize) -> io::Result<()> {
        let mut names = Vec::new();
        for child in fs::read_dir(path).map_err(|e| changed_if_gone(e, path, relative))? {
            let child = child.map_err(|e| with_path(e, path))?;
            if depth + 1 > self.limits.depth_max {
                let mut child_relative = relative.to_vec();
                push_component(&mut child_relative, child.file_name().as_encoded_bytes());
                let path = display(&child_relative);
                return Err(MemoryDigestError::DepthExceeded { path, depth_max: self.limits.depth_max }.into());
            }
            // Stop listing as soon as the names alone would exceed the entry bound.
            if self.entries + names.len() >= self.limits.entries_max {
                let path = display(relative);
                return Err(MemoryDigestError::EntriesExceeded { path, entries_max: self.limits.entries_max }.into());
            }
            names.push(child.file_name());
        }
        names.sort_unstable_by(|a, b| a.as_encoded_bytes().cmp(b.as_encoded_bytes()));
        for name in names {
            let child_path = path.join(&name);
            let mut child_relative = relative.to_vec();
            push_component(&mut child_relative, name.as_encoded_bytes());
            let metadata =
                fs::symlink_metadata(&child_path).map_err(|e| changed_if_gone(e, &child_path, &child_relative))?;
            self.entry(&child_path, &child_relative, &metadata, true, depth + 1)?;
        }
        Ok(())
    }
}

/// Feeds file bytes to the hasher without going through an intermediate buffer of the whole
/// file.
struct HashWriter<'h>(&'h mut Sha256);

impl Write for HashWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.0.update(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn push_component(relative: &mut Vec<u8>, name: &[u8]) {
    relative.push(b'/');
    relative.extend_from_slice(name);
}

fn display(relative: &[u8]) -> String {
    String::from_utf8_lossy(relative).into_owned()
}

fn changed(relative: &[u8]) -> io::Error {
    MemoryDigestError::ChangedDuringWalk { path: display(relative) }.into()
}

/// An entry that was listed and is gone by the time it is read changed during the walk.
fn changed_if_gone(error: io::Error, path: &Path, relative: &[u8]) -> io::Error {
    if error.kind() == io::ErrorKind::NotFound {
        changed(relative)
    } else {
        with_path(error, path)
    }
}

fn with_path(error: io::Error, path: &Path) -> io::Error {
    io::Error::new(error.kind(), format!("{}: {error}", path.display()))
}

#[cfg(unix)]
fn same_file(listed: &fs::Metadata, opened: &fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    listed.dev() == opened.dev() && listed.ino() == opened.ino()
}

#[cfg(not(unix))]
fn same_file(_listed: &fs::Metadata, _opened: &fs::Metadata) -> bool {
    true
}

#[cfg(all(test, unix))]
mod tests {
    use std::os::unix::fs::symlink;
    use std::time::{Duration, SystemTime};

    use super::*;

    fn digest(dir: &Path) -> [u8; 32] {
        memory_digest(dir).unwrap()
    }

    fn write(dir: &Path, relative: &str, content: &str) {
        let path = dir.join(relative);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, content).unwrap();
    }

    /// An agent directory with a memory, two notes and a scratch area next to them.
    fn agent_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "MEMORY.md", "# Memory\n- prefers short replies\n");
        write(dir.path(), "notes/people/ana.md", "Ana runs the release.\n");
        write(dir.path(), "notes/projects.md", "Wake engine.\n");
        write(dir.path(), "scratch/draft.txt", "half a thought\n");
        dir
    }

    /// The encoding of the module docs, written out by hand.
    struct Expected(Vec<u8>);

    impl Expected {
        fn new() -> Self {
            let mut expected = Expected(Vec::new());
            expected.field(MEMORY_DIGEST_VERSION_TAG.as_bytes());
            expected
        }
        fn field(&mut self, bytes: &[u8]) {
            self.0.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
            self.0.extend_from_slice(bytes);
        }
        fn record(mut self, kind: u8, path: &str, payload: Option<&[u8]>) -> Self {
            self.0.push(kind);
            self.field(path.as_bytes());
            if let Some(payload) = payload {
                self.field(payload);
            }
            self
        }
        fn digest(&self) -> [u8; 32] {
            Sha256::digest(&self.0).into()
        }
    }

    #[test]
    fn digest_follows_the_documented_format() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "MEMORY.md", "m");
        write(dir.path(), "notes/b", "bee");
        write(dir.path(), "notes/a.md", "a");
        write(dir.path(), "notes/a/x", "x");
        write(dir.path(), "notes/B", "upper case sorts first");
        symlink("b", dir.path().join("notes/link")).unwrap();
        fs::create_dir(dir.path().join("notes/empty")).unwrap();
        let expected = Expected::new()
            .record(KIND_REGULAR_FILE, "MEMORY.md", Some(b"m"))
            .record(KIND_DIRECTORY, "notes", None)
            .record(KIND_REGULAR_FILE, "notes/B", Some(b"upper case sorts first"))
            .record(KIND_DIRECTORY, "notes/a", None)
            .record(KIND_REGULAR_FILE, "notes/a/x", Some(b"x"))
            .record(KIND_REGULAR_FILE, "notes/a.md", Some(b"a"))
            .record(KIND_REGULAR_FILE, "notes/b", Some(b"bee"))
            .record(KIND_DIRECTORY, "notes/empty", None)
            .record(KIND_SYMLINK, "notes/link", Some(b"b"));
        assert_eq!(digest(dir.path()), expected.digest());

        let empty = tempfile::tempdir().unwrap();
        let expected =
            Expected::new().record(KIND_MISSING_FILE, "MEMORY.md", None).record(KIND_MISSING_DIRECTORY, "notes", None);
        assert_eq!(digest(empty.path()), expected.digest());
        // Frozen (also computed independently in Python): a change needs a new version tag.
        assert_eq!(
            memory_digest_hex(empty.path()).unwrap(),
            "d6495dac71532f69e80e83c48dfa8f367c9f64bcff9821cafccc7cdf148fb055"
        );
    }

    #[test]
    fn writing_memory_or_a_note_changes_it() {
        let dir = agent_dir();
        let before = digest(dir.path());
        write(dir.path(), "MEMORY.md", "# Memory\n- prefers short replies\n- on leave in May\n");
        let after_memory = digest(dir.path());
        assert_ne!(before, after_memory);
        write(dir.path(), "notes/people/ana.md", "Ana runs the release train.\n");
        let after_note = digest(dir.path());
        assert_ne!(after_memory, after_note);
        write(dir.path(), "notes/people/ben.md", "");
        assert_ne!(after_note, digest(dir.path()));
    }

    #[test]
    fn renaming_a_file_into_notes_or_within_it_changes_it() {
        let dir = agent_dir();
        let before = digest(dir.path());
        fs::rename(dir.path().join("scratch/draft.txt"), dir.path().join("notes/draft.txt")).unwrap();
        let moved_in = digest(dir.path());
        assert_ne!(before, moved_in);
        fs::rename(dir.path().join("notes/draft.txt"), dir.path().join("notes/people/draft.txt")).unwrap();
        assert_ne!(moved_in, digest(dir.path()));
    }

    #[test]
    fn symlinks_are_recorded_as_links_and_never_followed() {
        let dir = agent_dir();
        write(dir.path(), "elsewhere/a.md", "outside a\n");
        write(dir.path(), "elsewhere/b.md", "outside b\n");
        symlink("../elsewhere/a.md", dir.path().join("notes/linked.md")).unwrap();
        let linked_a = digest(dir.path());

        // The target's content is not part of the digest.
        write(dir.path(), "elsewhere/a.md", "outside a, edited\n");
        assert_eq!(linked_a, digest(dir.path()));

        // The link text is.
        fs::remove_file(dir.path().join("notes/linked.md")).unwrap();
        symlink("../elsewhere/b.md", dir.path().join("notes/linked.md")).unwrap();
        assert_ne!(linked_a, digest(dir.path()));

        // A link is not the file it points to, and a link to a directory is not descended.
        fs::remove_file(dir.path().join("notes/linked.md")).unwrap();
        fs::copy(dir.path().join("elsewhere/b.md"), dir.path().join("notes/linked.md")).unwrap();
        let copied = digest(dir.path());
        assert_ne!(linked_a, copied);
        symlink("../elsewhere", dir.path().join("notes/elsewhere")).unwrap();
        let dir_link = digest(dir.path());
        write(dir.path(), "elsewhere/c.md", "new outside\n");
        assert_eq!(dir_link, digest(dir.path()));

        // MEMORY.md and notes themselves may be links; they are recorded, not followed.
        fs::rename(dir.path().join("notes"), dir.path().join("real-notes")).unwrap();
        symlink("real-notes", dir.path().join("notes")).unwrap();
        let notes_link = digest(dir.path());
        write(dir.path(), "real-notes/projects.md", "Changed behind the link.\n");
        assert_eq!(notes_link, digest(dir.path()));
        // A dangling link digests fine.
        symlink("missing.md", dir.path().join("MEMORY.md.tmp")).unwrap();
        fs::rename(dir.path().join("MEMORY.md.tmp"), dir.path().join("MEMORY.md")).unwrap();
        assert_ne!(notes_link, digest(dir.path()));
    }

    #[test]
    fn touching_without_changing_content_leaves_it() {
        let dir = agent_dir();
        let before = digest(dir.path());
        let later = SystemTime::now() + Duration::from_secs(3600);
        for relative in ["MEMORY.md", "notes/projects.md"] {
            File::options().write(true).open(dir.path().join(relative)).unwrap().set_modified(later).unwrap();
        }
        // Rewriting the same bytes (a new inode) is no change either.
        let content = fs::read(dir.path().join("notes/people/ana.md")).unwrap();
        fs::remove_file(dir.path().join("notes/people/ana.md")).unwrap();
        fs::write(dir.path().join("notes/people/ana.md"), content).unwrap();
        assert_eq!(before, digest(dir.path()));
    }

    #[test]
    fn files_outside_memory_and_notes_do_not_count() {
        let dir = agent_dir();
        let before = digest(dir.path());
        write(dir.path(), "scratch/draft.txt", "a whole new thought\n");
        write(dir.path(), "MEMORY.md.bak", "old memory\n");
        write(dir.path(), "notes.md", "not the notes directory\n");
        write(dir.path(), "notesx/a.md", "nor this\n");
        assert_eq!(before, digest(dir.path()));
    }

    #[test]
    fn absence_is_not_emptiness() {
        let dir = tempfile::tempdir().unwrap();
        let missing = digest(dir.path());
        write(dir.path(), "MEMORY.md", "");
        let empty_memory = digest(dir.path());
        assert_ne!(missing, empty_memory);
        fs::create_dir(dir.path().join("notes")).unwrap();
        let empty_notes = digest(dir.path());
        assert_ne!(empty_memory, empty_notes);
        fs::remove_dir(dir.path().join("notes")).unwrap();
        write(dir.path(), "notes", "");
        assert_ne!(empty_notes, digest(dir.path()));
        assert_ne!(empty_memory, digest(dir.path()));
    }

    #[test]
    fn other_file_types_are_recorded_without_reading_them() {
        let dir = agent_dir();
        let before = digest(dir.path());
        let _socket = std::os::unix::net::UnixListener::bind(dir.path().join("notes/runtime.sock")).unwrap();
        assert_ne!(before, digest(dir.path()));
    }

    #[test]
    fn a_memory_directory_is_recorded_but_not_descended() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("MEMORY.md")).unwrap();
        let before = digest(dir.path());
        write(dir.path(), "MEMORY.md/inner.md", "not read\n");
        assert_eq!(before, digest(dir.path()));
    }

    #[test]
    fn the_directory_itself_must_exist() {
        let dir = tempfile::tempdir().unwrap();
        let error = memory_digest(&dir.path().join("typo")).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::NotFound);
        write(dir.path(), "file", "");
        let error = memory_digest(&dir.path().join("file")).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::NotADirectory);
    }

    #[test]
    fn limits_fail_the_digest() {
        let dir = agent_dir();
        let limits = MemoryDigestLimits::default();
        let fails = |limits: MemoryDigestLimits| {
            let error = memory_digest_with_limits(dir.path(), limits).unwrap_err();
            MemoryDigestError::of(&error).unwrap().to_string()
        };
        // MEMORY.md, notes, notes/people, notes/people/ana.md, notes/projects.md.
        assert!(memory_digest_with_limits(dir.path(), MemoryDigestLimits { entries_max: 5, ..limits }).is_ok());
        assert_eq!(
            fails(MemoryDigestLimits { entries_max: 4, ..limits }),
            "notes/projects.md: more than 4 entries in MEMORY.md and notes/"
        );
        assert_eq!(
            fails(MemoryDigestLimits { entries_max: 3, ..limits }),
            "notes: more than 3 entries in MEMORY.md and notes/"
        );
        assert!(memory_digest_with_limits(dir.path(), MemoryDigestLimits { depth_max: 2, ..limits }).is_ok());
        assert_eq!(
            fails(MemoryDigestLimits { depth_max: 1, ..limits }),
            "notes/people/ana.md: nested deeper below notes/ than the limit of 1"
        );
        let total: u64 = ["MEMORY.md", "notes/people/ana.md", "notes/projects.md"]
            .iter()
            .map(|relative| fs::metadata(dir.path().join(relative)).unwrap().len())
            .sum();
        assert_eq!(total, 68);
        assert!(memory_digest_with_limits(dir.path(), MemoryDigestLimits { bytes_max: total, ..limits }).is_ok());
        assert_eq!(
            fails(MemoryDigestLimits { bytes_max: total - 1, ..limits }),
            "notes/projects.md: more than 67 bytes in MEMORY.md and notes/"
        );
    }
}
