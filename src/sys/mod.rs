//! Every system call of the crate, made through `rustix` (`libc` only where rustix has none);
//! what each file holds: `README.md`.

mod child;
mod futex;
pub(crate) mod kill;
mod limits;
mod mapping;
mod memory;
mod named;
mod pipe;
mod process;
#[cfg(feature = "cuda")]
mod shm;
mod socket;
#[cfg(feature = "remote")]
pub(crate) mod tcp;

pub(crate) use child::{ChildWatch, Exit};
pub(crate) use futex::{futex_wait, futex_wake, futex_wake_all};
pub(crate) use kill::point as kill_point;
pub(crate) use limits::{
    descriptor_limit, near_descriptor_limit, out_of_descriptors, physical_memory, raise_descriptor_limit,
};
pub(crate) use mapping::Mapping;
pub(crate) use memory::MemoryFile;
pub(crate) use named::{NamedMemory, publish, read_published};
#[cfg(all(feature = "cuda", any(test, feature = "testing")))]
pub(crate) use pipe::is_pipe_writer;
#[cfg(feature = "cuda")]
pub(crate) use pipe::same_open_file;
pub(crate) use pipe::{
    RECORD_MAX, accept_pipe_writer, identity as file_identity, lease_pipe, read_available, same_file, try_write_record,
    write_record,
};
#[cfg(test)]
pub(crate) use process::fork_and_run;
pub(crate) use process::{
    SIGKILL, at_exit, at_fork, close_inherited, close_inherited_shared, ending, own_pid, own_start, pid_namespace,
    process_gone, signal_name,
};
#[cfg(feature = "cuda")]
pub(crate) use shm::{ShmFile, ShmOpen, remove_cuda_event_files, shm_unlink};
#[cfg(feature = "remote")]
pub(crate) use socket::wait_for;
pub(crate) use socket::{
    Listening, Lost, MESSAGE_FDS, Message, Received, Socket, Wait, bell, connect_abstract_within, connect_to,
    is_disconnect, peer_gone as reader_gone, peer_gone as writers_gone, private_dir, ring, silence, wait_readable,
    wait_readable_or_closed,
};

/// 128 random bits from the kernel (`getrandom`): names and secrets no other process can guess.
pub(crate) fn random_u128() -> u128 {
    let mut bytes = [0u8; 16];
    if random_bytes(&mut bytes).is_ok() {
        return u128::from_le_bytes(bytes);
    }
    // Not expected on any kernel cuda-mp runs on; a weaker source beats failing: the standard
    // library's per-process random hash keys and the clock.
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    let hi = h.finish();
    h.write_u64(hi);
    ((hi as u128) << 64) | h.finish() as u128
}

/// Fills `out` with random bytes from the kernel (`getrandom`), or fails: for nonces of an
/// authentication, which no weaker source may stand in for.
pub(crate) fn random_bytes(out: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < out.len() {
        match rustix::rand::getrandom(&mut out[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// A descriptor held by a message being built, until it is sent.
pub(crate) type Held = std::sync::Arc<dyn std::os::fd::AsFd + Send + Sync>;

/// The descriptors of `fds`, borrowed for a send.
pub(crate) fn borrow_all(fds: &[Held]) -> Vec<std::os::fd::BorrowedFd<'_>> {
    fds.iter().map(|fd| fd.as_fd()).collect()
}
