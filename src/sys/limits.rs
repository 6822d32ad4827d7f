//! Limits of this process and machine: open descriptors (`RLIMIT_NOFILE`), physical memory.

use std::sync::Once;

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// The soft limit on open descriptors of this process (0 when unknown).
pub(crate) fn descriptor_limit() -> u64 {
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// Slots of the descriptor table made ready at once (see [`raise_descriptor_limit`]).
const TABLE_SLOTS: u64 = 4096;

/// Lifts the soft limit on open descriptors to the hard limit, once per process: every shared
/// storage and every lease is a descriptor, as every connection is for a server. Also grows
/// the process's descriptor table to [`TABLE_SLOTS`] slots at once: the kernel grows it by
/// doubling as descriptors are opened, and in a process of several threads each growth waits
/// for an RCU grace period (measured: 5-23 ms on the H200 machines, during which every thread
/// that opens or receives a descriptor waits too), so a few growths while the first weights
/// arrive cost tens of milliseconds. Grown here, early (in `init`, before other threads), it
/// costs one allocation (a descriptor duplicated to the number `TABLE_SLOTS - 1`, and closed at
/// once, makes the kernel grow it in one step); the table never shrinks.
pub(crate) fn raise_descriptor_limit() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let limit = getrlimit(Resource::Nofile);
        if limit.current != limit.maximum {
            // Raising the soft limit up to the hard one is always allowed.
            let _ = setrlimit(Resource::Nofile, Rlimit { current: limit.maximum, maximum: limit.maximum });
        }
        let slots = TABLE_SLOTS.min(descriptor_limit());
        if let Some(top) = slots.checked_sub(1).and_then(|t| i32::try_from(t).ok())
            && let Ok(probe) = crate::sys::bell()
        {
            let _ = rustix::io::fcntl_dupfd_cloexec(&probe, top);
        }
    });
}

/// Bytes of physical memory of this machine (0 when unknown).
pub(crate) fn physical_memory() -> u64 {
    // Asked once: every host allocation checks against it.
    static TOTAL: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TOTAL.get_or_init(|| {
        let info = rustix::system::sysinfo();
        (info.totalram as u64).saturating_mul(info.mem_unit.max(1) as u64)
    })
}

/// True when this process is at, or within 64 descriptors of, its limit on open descriptors: a
/// message whose descriptors could not all be received was probably cut short by the limit,
/// and dropping it has freed what did arrive.
pub(crate) fn near_descriptor_limit() -> bool {
    let open = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as u64).unwrap_or(0);
    out_of_descriptors() || open + 64 >= descriptor_limit()
}

/// True when this process cannot open one more descriptor (`EMFILE`/`ENFILE`): probes with an
/// `eventfd`, closed at once.
pub(crate) fn out_of_descriptors() -> bool {
    match crate::sys::bell() {
        Ok(_) => false,
        Err(e) => matches!(
            e.raw_os_error(),
            Some(code) if code == rustix::io::Errno::MFILE.raw_os_error() || code == rustix::io::Errno::NFILE.raw_os_error()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limits_are_known() {
        raise_descriptor_limit();
        // The descriptor table was grown in one step (the kernel reports its size).
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let size: u64 = status.lines().find_map(|l| l.strip_prefix("FDSize:")).unwrap().trim().parse().unwrap();
        assert!(size >= TABLE_SLOTS.min(descriptor_limit()), "FDSize {size}");
        assert!(descriptor_limit() > 64);
        assert!(!out_of_descriptors());
        assert!(physical_memory() > 1 << 20);
    }
}
