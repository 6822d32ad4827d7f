//! Named connections between processes of one user only: a peer of another user, at either end,
//! is refused before anything of it is used (the kernel's record of the peer, `SO_PEERCRED`).

use std::time::Duration;

use cuda_mp::{Error, Listener, Sender, channel, spawn};

mod common;

cuda_mp::enable_test_support!();

const WAIT: Duration = Duration::from_secs(20);
const NOBODY: u32 = 65534;

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Becomes user `nobody` (this process only).
fn become_nobody() {
    // SAFETY: plain system calls on this process's credentials; nothing else is touched.
    let ok =
        unsafe { libc::setgroups(0, std::ptr::null()) == 0 && libc::setgid(NOBODY) == 0 && libc::setuid(NOBODY) == 0 };
    assert!(ok, "cannot become user {NOBODY}: {}", std::io::Error::last_os_error());
}

/// As another user: connects to `name` and says a well-formed hello (no cuda-mp on this end,
/// whose own connect would refuse a listener of another user): the transport's header (one
/// descriptor), the magic and version, and 64 bytes of sealed shared memory for the counters.
/// True once it connected.
fn connect_as_nobody(name: String) -> bool {
    use rustix::net::{AddressFamily, SendAncillaryBuffer, SendAncillaryMessage, connect, sendmsg, socket_with};
    use rustix::net::{SendFlags, SocketAddrUnix, SocketFlags, SocketType};
    use std::os::fd::AsFd;
    let gauge = common::sealed_memory(64, 0);
    become_nobody();
    let Ok(fd) = socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None) else {
        return false;
    };
    if connect(&fd, &SocketAddrUnix::new(name.as_str()).unwrap()).is_err() {
        return false;
    }
    // The transport's header (one descriptor), then a hello: magic, version 13 (the protocol's
    // now), message type.
    let mut hello = 1u32.to_le_bytes().to_vec();
    hello.extend_from_slice(b"cuda-mp\0");
    hello.extend_from_slice(&[13, 2, b'u', b'8']);
    let fds = [gauge.as_fd()];
    let mut space = vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    control.push(SendAncillaryMessage::ScmRights(&fds));
    // The listener may refuse (and close) the connection before this send: that is no failure
    // of the peer's.
    let _ = sendmsg(&fd, &[std::io::IoSlice::new(&hello)], &mut control, SendFlags::NOSIGNAL);
    true
}

/// As another user: listens, says where, and waits for a word before exiting.
fn listen_as_nobody((names, done): (Sender<String>, cuda_mp::Receiver<()>)) {
    become_nobody();
    let listener = Listener::<u8>::bind().unwrap();
    names.send(listener.name().to_string()).unwrap();
    let _ = listener.accept_timeout(WAIT);
    let _ = done.recv_timeout(WAIT);
}

fn assert_refused(e: &Error, what: &str) {
    match e {
        Error::Io(io) => {
            assert_eq!(io.kind(), std::io::ErrorKind::PermissionDenied, "{what}: {io}");
            assert!(io.to_string().contains("refused"), "{what}: {io}");
        }
        other => panic!("{what}: expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_peer_of_this_user_connects() {
    let listener = Listener::<u8>::bind().unwrap();
    let tx = Sender::<u8>::connect(listener.name()).unwrap();
    let rx = listener.accept_timeout(WAIT).unwrap();
    tx.send(7).unwrap();
    assert_eq!(rx.recv_timeout(WAIT).unwrap(), 7);
}

#[test]
fn a_sender_of_another_user_is_refused_by_the_listener() {
    if !is_root() {
        eprintln!("only root can run a peer as another user: the cross-user half is not run");
        return;
    }
    let listener = Listener::<u8>::bind().unwrap();
    // The listener's socket lives in a directory only its user may enter, so another user
    // cannot even connect. Reachable here by anyone, through a link in an open directory (as
    // if the name were): the listener must still refuse the peer.
    use std::os::unix::fs::PermissionsExt;
    let open_dir = std::env::temp_dir().join(format!("cuda-mp-open-{}", std::process::id()));
    std::fs::create_dir_all(&open_dir).unwrap();
    std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let reachable = open_dir.join("listener");
    let _ = std::fs::remove_file(&reachable);
    std::fs::hard_link(listener.name(), &reachable).unwrap();
    std::fs::set_permissions(&reachable, std::fs::Permissions::from_mode(0o777)).unwrap();
    let peer = spawn(reachable.to_str().unwrap().to_string(), connect_as_nobody);
    let e = listener.accept_timeout(WAIT).unwrap_err();
    assert_refused(&e, "a sender running as nobody");
    assert!(peer.join().unwrap(), "the peer connected");
    std::fs::remove_dir_all(&open_dir).unwrap();
}

#[test]
fn a_listener_of_another_user_is_refused_by_the_sender() {
    if !is_root() {
        eprintln!("only root can run a peer as another user: the cross-user half is not run");
        return;
    }
    let (names_tx, names) = channel().unwrap();
    let (done, done_rx) = channel().unwrap();
    let peer = spawn((names_tx, done_rx), listen_as_nobody);
    let name: String = names.recv_timeout(WAIT).unwrap();
    let e = Sender::<u8>::connect(&name).unwrap_err();
    assert_refused(&e, "a listener running as nobody");
    done.send(()).unwrap();
    peer.join().unwrap();
}

/// As another user: connects to the home (abstract name) `name`, asks for a deposit with 16
/// bytes, and gives how many bytes came back before the connection closed (`None`: it could
/// not connect at all).
fn ask_home_as_nobody(name: String) -> Option<usize> {
    use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketAddrUnix, SocketFlags, SocketType};
    use rustix::net::{connect, recv, send, socket_with};
    become_nobody();
    let fd = socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).ok()?;
    connect(&fd, &SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap()).ok()?;
    let mut request = 0u32.to_le_bytes().to_vec(); // the transport's header: no descriptor
    request.extend_from_slice(&[0xab; 16]);
    let _ = send(&fd, &request, SendFlags::NOSIGNAL);
    let mut answer = [0u8; 64];
    Some(recv(&fd, &mut answer, RecvFlags::empty()).map_or(0, |(n, _)| n))
}

#[test]
fn a_process_of_another_user_gets_nothing_from_a_home_which_goes_on_serving() {
    if !is_root() {
        eprintln!("only root can run a peer as another user: the cross-user half is not run");
        return;
    }
    let t = cuda_mp::HostTensor::<f32>::full(&[16], 3.0).unwrap();
    let bytes = cuda_mp::to_bytes(&t, WAIT).unwrap();
    let at = bytes.windows(13).position(|w| w == b"cuda-mp-home-").expect("a ticket in the bytes");
    let home = String::from_utf8(bytes[at..at + 13 + 32].to_vec()).unwrap();
    let answered = spawn(home, ask_home_as_nobody).join().unwrap();
    assert_eq!(answered, Some(0), "connected, and closed without an answer");
    let back: cuda_mp::HostTensor<f32> = cuda_mp::from_bytes(&bytes).unwrap();
    assert_eq!(back.to_vec(), vec![3.0; 16], "the home still serves this user");
}

/// In a child whose temporary directory is `tmp`, where another user made this user's
/// directory for listeners first: binds a listener, connects to it and sends a value. Gives
/// the listener's name, the value received, and the owner and mode of its directory.
fn listen_beside_a_squatter(tmp: String) -> Result<(String, u32, u32, u32), String> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: the child's own environment, set before any thread of it reads it.
    unsafe { std::env::set_var("TMPDIR", &tmp) };
    let listener = Listener::<u32>::bind().map_err(|e| e.to_string())?;
    let name = listener.name().to_string();
    let tx = Sender::<u32>::connect(&name).map_err(|e| e.to_string())?;
    let rx = listener.accept_timeout(WAIT).map_err(|e| e.to_string())?;
    tx.send(7).map_err(|e| e.to_string())?;
    let value = rx.recv_timeout(WAIT).map_err(|e| e.to_string())?;
    let meta = std::fs::metadata(std::path::Path::new(&name).parent().unwrap()).map_err(|e| e.to_string())?;
    Ok((name, value, meta.uid(), meta.mode() & 0o777))
}

#[test]
fn a_listeners_directory_taken_by_another_user_does_not_stop_this_users_listeners() {
    if !is_root() {
        eprintln!("only root can make a directory of another user: the test is not run");
        return;
    }
    use std::os::unix::fs::DirBuilderExt;
    let tmp = std::env::temp_dir().join(format!("cuda-mp-squat-test-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let uid = rustix::process::geteuid().as_raw();
    let squatted = tmp.join(format!("cuda-mp-{uid}"));
    std::fs::DirBuilder::new().mode(0o700).create(&squatted).unwrap();
    std::os::unix::fs::chown(&squatted, Some(NOBODY), Some(NOBODY)).unwrap();
    let got = spawn(tmp.to_string_lossy().into_owned(), listen_beside_a_squatter).join().unwrap();
    let (name, value, owner, mode) = got.expect("a listener binds beside the squatter's directory");
    assert_eq!(value, 7);
    let dir = std::path::Path::new(&name).parent().unwrap();
    assert_ne!(dir, squatted, "{name}");
    assert_eq!((owner, mode), (uid, 0o700), "{name}: a directory of this user's alone");
    common::eventually(WAIT, "the child's directory is removed at its exit", || !dir.exists());
    std::fs::remove_dir_all(&tmp).unwrap();
}
