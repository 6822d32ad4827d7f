//! Limits of this process and machine: open descriptors (`RLIMIT_NOFILE`), physical memory.

use std::sync::Once;

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

/// The soft limit on open descriptors of this process (0 when unknown).
pub(crate) fn descriptor_limit() -> u64 {
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// Lifts the soft limit on open descriptors to the hard limit, once per process: every shared
/// storage and every lease is a descriptor, as every connection is for a server.
pub(crate) fn raise_descriptor_limit() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let limit = getrlimit(Resource::Nofile);
        if limit.current != limit.maximum {
            // Raising the soft limit up to the hard one is always allowed.
            let _ = setrlimit(Resource::Nofile, Rlimit { current: limit.maximum, maximum: limit.maximum });
        }
    });
}

/// Bytes of physical memory of this machine (0 when unknown).
pub(crate) fn physical_memory() -> u64 {
    let info = rustix::system::sysinfo();
    (info.totalram as u64).saturating_mul(info.mem_unit.max(1) as u64)
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
        assert!(descriptor_limit() > 64);
        assert!(!out_of_descriptors());
        assert!(physical_memory() > 1 << 20);
    }
}
