//! Operating-system calls made through `rustix` (safe wrappers, descriptors as `OwnedFd` /
//! `BorrowedFd`): the one local transport (`socket.rs`: messages with any number of
//! descriptors on Unix sockets, listeners, who is at a socket's other end, `poll`, `eventfd`),
//! shared memory files (`memory.rs`), named POSIX shared memory (`shm.rs`), descriptor and
//! memory limits (`limits.rs`) and watching a child's end (`child.rs`). See `README.md`.

mod child;
mod limits;
mod memory;
mod shm;
mod socket;

pub(crate) use child::{ChildWatch, Exit};
pub(crate) use limits::{
    descriptor_limit, near_descriptor_limit, out_of_descriptors, physical_memory, raise_descriptor_limit,
};
pub(crate) use memory::MemoryFile;
pub(crate) use shm::{shm_unlink, ShmFile, ShmOpen};
pub(crate) use socket::{
    bell, connect_to, private_dir, ring, silence, wait_for, wait_readable, Listening, Socket, Wait, MESSAGE_FDS,
};

/// 128 random bits from the kernel (`getrandom`): names and secrets no other process can guess.
pub(crate) fn random_u128() -> u128 {
    let mut bytes = [0u8; 16];
    let mut filled = 0;
    while filled < bytes.len() {
        match rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            // Not expected on any kernel cuda-mp runs on; a weaker source beats failing.
            Err(_) => return crate::lifetime::process_token() ^ std::time::Instant::now().elapsed().as_nanos(),
        }
    }
    u128::from_le_bytes(bytes)
}
