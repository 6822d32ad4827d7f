//! Proving a shared secret in a remote channel's handshake. Each end sends a fresh random
//! nonce; each proves the secret with an HMAC-SHA256, under it, of its role and both nonces
//! (its peer's first). A proof cannot be replayed (the peer's nonce is new every time) nor
//! reflected (the roles differ), and an end that does not know the secret learns nothing from
//! a proof but that its peer knows one.

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

/// Bytes of a nonce.
pub(super) const NONCE: usize = 32;
/// Bytes of a proof.
pub(super) const PROOF: usize = 32;
/// The shortest secret accepted.
pub(super) const MIN_SECRET: usize = 16;

/// Who proves: the listening end, or the connecting one.
#[derive(Debug, Clone, Copy)]
pub(super) enum Role {
    Listener,
    Connector,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Listener => b"cuda-mp remote listener",
            Role::Connector => b"cuda-mp remote connector",
        }
    }
}

/// The secret both ends of a remote channel hold. Its `Debug` shows none of it.
#[derive(Clone)]
pub(super) struct Secret(Arc<[u8]>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

impl Secret {
    /// A secret of these bytes (checked by [`check`](Self::check) before use).
    pub(super) fn new(bytes: &[u8]) -> Secret {
        Secret(bytes.into())
    }

    /// Refuses a secret shorter than [`MIN_SECRET`] bytes.
    pub(super) fn check(&self) -> Result<()> {
        if self.0.len() < MIN_SECRET {
            return Err(Error::Unsupported(format!(
                "a remote channel's secret must have at least {MIN_SECRET} bytes, not {}",
                self.0.len()
            )));
        }
        Ok(())
    }

    fn mac(&self, role: Role, theirs: &[u8; NONCE], ours: &[u8; NONCE]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(role.label());
        mac.update(theirs);
        mac.update(ours);
        mac
    }

    /// This end's proof, in `role`, after the peer's nonce `theirs` and ours.
    pub(super) fn prove(&self, role: Role, theirs: &[u8; NONCE], ours: &[u8; NONCE]) -> [u8; PROOF] {
        self.mac(role, theirs, ours).finalize().into_bytes().into()
    }

    /// Whether `proof` is the peer's, in `role`, after our nonce `ours` and the peer's
    /// `theirs` (compared in constant time).
    pub(super) fn verify(&self, role: Role, ours: &[u8; NONCE], theirs: &[u8; NONCE], proof: &[u8; PROOF]) -> bool {
        self.mac(role, ours, theirs).verify_slice(proof).is_ok()
    }
}

/// A fresh random nonce.
pub(super) fn nonce() -> Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    crate::sys::random_bytes(&mut n)?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_verifies_only_with_the_secret_the_nonces_and_the_role() {
        let secret = Secret::new(b"sixteen bytes ok");
        let other = Secret::new(b"sixteen bytes no");
        assert!(secret.check().is_ok());
        let (a, b) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(a, b);
        let proof = secret.prove(Role::Listener, &a, &b);
        assert!(secret.verify(Role::Listener, &a, &b, &proof));
        assert!(!other.verify(Role::Listener, &a, &b, &proof), "another secret");
        assert!(!secret.verify(Role::Connector, &a, &b, &proof), "reflected to the other role");
        assert!(!secret.verify(Role::Listener, &b, &a, &proof), "nonces swapped");
        assert!(!secret.verify(Role::Listener, &nonce().unwrap(), &b, &proof), "replayed to a new nonce");
        let mut flipped = proof;
        flipped[31] ^= 1;
        assert!(!secret.verify(Role::Listener, &a, &b, &flipped));
        assert!(Secret::new(b"short").check().is_err());
        assert_eq!(format!("{secret:?}"), "Secret(16 bytes)");
    }
}
