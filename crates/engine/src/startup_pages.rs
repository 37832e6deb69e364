//! Small pages while an instance starts.
//!
//! The allocator asks the kernel for transparent huge pages (`madvise`), and the kernel zeroes
//! each 2 MiB page when it is first touched. A start allocates its whole restored state at once
//! (about 300 MiB for the scale figure's 1.6M-event history), so that zeroing sits on the path
//! to serving. On the 2-core VMs this project is measured on, free memory is handed back to the
//! host, and a start whose state landed in huge pages was fast only when another process had
//! just freed them: otherwise it spent 0.7–2.5 s in the kernel (`perf`: `clear_page_erms` under
//! `do_huge_pmd_anonymous_page`), and restarts of the scale history took 0.41–2.60 s. In 4 KiB
//! pages the same restarts took 0.52–0.60 s (README, "The scale figure").
//!
//! So huge pages are off while any instance of the process starts (`PR_SET_THP_DISABLE`, which
//! holds for the whole process), and back on once every start has finished, unless the process
//! asked for small pages for good ([`small_pages_from_now_on`]), as `anima-wake serve` does by
//! default since they also cost RSS and throughput under load.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Instances of this process starting now.
static STARTING: AtomicUsize = AtomicUsize::new(0);

/// Set by [`small_pages_from_now_on`]: no start turns huge pages back on.
static ALWAYS_SMALL: AtomicBool = AtomicBool::new(false);

/// Huge pages off for the rest of the process's life, not only while instances start. What
/// `anima-wake serve` does unless `[runner] transparent_huge_pages = true`: under `anima-load`
/// (60 s runs, 4 alternated pairs) the engine without them ended at 613–641 MiB RSS against
/// 691–720 MiB with them, at the same throughput within the noise (README, "Load it").
pub fn small_pages_from_now_on() {
    ALWAYS_SMALL.store(true, Ordering::SeqCst);
    set_huge_pages_off(true);
}

/// Held while an instance starts: the first one turns huge pages off, the last one to finish
/// turns them back on. A process started with huge pages off keeps them off.
pub struct SmallPagesWhileStarting {
    counted: bool,
}

impl SmallPagesWhileStarting {
    pub fn begin() -> Self {
        if huge_pages_off_already() {
            return SmallPagesWhileStarting { counted: false };
        }
        if STARTING.fetch_add(1, Ordering::SeqCst) == 0 {
            set_huge_pages_off(true);
        }
        SmallPagesWhileStarting { counted: true }
    }
}

impl Drop for SmallPagesWhileStarting {
    fn drop(&mut self) {
        if self.counted && STARTING.fetch_sub(1, Ordering::SeqCst) == 1 && !ALWAYS_SMALL.load(Ordering::SeqCst) {
            set_huge_pages_off(false);
        }
    }
}

/// Whether huge pages were off before any start of this process turned them off.
fn huge_pages_off_already() -> bool {
    STARTING.load(Ordering::SeqCst) == 0 && rustix::thread::transparent_huge_pages_are_disabled().unwrap_or(false)
}

fn set_huge_pages_off(off: bool) {
    // Only a hint for the kernel's choice of page size: a kernel without the call starts as before.
    if let Err(e) = rustix::thread::disable_transparent_huge_pages(off) {
        tracing::debug!(error = %e, off, "transparent huge pages setting not changed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Starts overlap in one process (tests, several instances): huge pages are off from the
    /// first start until the last one ends, then as they were; once the process asks for small
    /// pages for good, no start turns them back on. (One test: the setting is the process's.)
    #[test]
    fn huge_pages_are_off_only_while_instances_start() {
        let off = || rustix::thread::transparent_huge_pages_are_disabled().expect("prctl");
        let before = off();
        let first = SmallPagesWhileStarting::begin();
        assert!(off(), "off while one instance starts");
        let second = SmallPagesWhileStarting::begin();
        drop(first);
        assert!(off(), "still off while another one starts");
        drop(second);
        assert_eq!(off(), before, "as before once every start has ended");
        // `anima-wake serve`'s default: off for good, even across a start already under way.
        let under_way = SmallPagesWhileStarting::begin();
        small_pages_from_now_on();
        drop(under_way);
        assert!(off(), "still off after the start under way ended");
        drop(SmallPagesWhileStarting::begin());
        assert!(off(), "and after a later start");
    }
}
