//! Operating-system calls made through `rustix` (safe wrappers, descriptors as `OwnedFd` /
//! `BorrowedFd`): the layer the rest of the crate's system calls move into. Now: messages with
//! descriptors on Unix sockets (`uds.rs`).

mod uds;

pub(crate) use uds::{recv_with_fds, send_with_fds};
