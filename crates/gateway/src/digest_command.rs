//! `anima-wake digest DIR`: prints the memory digest of an agent directory (its `MEMORY.md` and
//! `notes/` tree) as `<hex>  <DIR>`, the reference output runtimes compare their own
//! implementation against. The format lives in [`anima_engine::digest`].

use std::path::Path;

use anyhow::Context;

/// Prints `<64 hex digits>  <dir>` on stdout (the layout of `sha256sum`).
pub fn run(dir: &Path) -> anyhow::Result<()> {
    println!("{}", line(dir)?);
    Ok(())
}

/// The line [`run`] prints.
pub fn line(dir: &Path) -> anyhow::Result<String> {
    let digest =
        anima_engine::digest::memory_digest_hex(dir).with_context(|| format!("memory digest of {}", dir.display()))?;
    Ok(format!("{digest}  {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_the_digest_and_the_directory() {
        // The crate's sources hold neither MEMORY.md nor notes/: the digest of an empty memory.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        assert_eq!(
            line(&dir).unwrap(),
            format!("d6495dac71532f69e80e83c48dfa8f367c9f64bcff9821cafccc7cdf148fb055  {}", dir.display())
        );
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_it() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("no-such-agent");
        let error = format!("{:#}", line(&dir).unwrap_err());
        assert!(error.starts_with(&format!("memory digest of {}: ", dir.display())), "{error}");
    }
}
