//! The seal on the copies courier stores: proof that a `courier-*` state
//! (attempt, first attempt, deliveries, replays) was written by courier
//! and not by a producer. Every broker that stores copies uses it.

use bytes::Bytes;
use ring::hmac;

use super::shared::{F_RETRY_AT, F_SUBJECT, without};
use crate::model::{F_ATTEMPT, F_DELIVERIES, F_FIRST_ATTEMPT_AT, F_MESSAGE_ID, F_REPLAYS, F_SEAL};

/// The `courier-*` fields that are courier's state about a stored copy,
/// in the order the seal covers them. Redis's scripts list them too
/// (`redis/poison.rs`), in the same order.
pub const STATE_FIELDS: [&str; 7] = [
    F_MESSAGE_ID,
    F_ATTEMPT,
    F_FIRST_ATTEMPT_AT,
    F_RETRY_AT,
    F_DELIVERIES,
    F_REPLAYS,
    F_SUBJECT,
];

/// The length of a seal key in bytes; at most one SHA-1 block (64), so
/// that the HMAC pads are the key itself, padded (see [`Seal::pads`]).
pub const SEAL_KEY_BYTES: usize = 32;

/// Proof that courier wrote the `courier-*` state of a copy it stored
/// (a retry, a re-published redelivery, a replayed dead letter): the field
/// `courier-seal`, an HMAC over [`STATE_FIELDS`] with a random key kept in
/// the broker per queue. A producer can write any `courier-*` field, but
/// not a seal: a copy without a valid one is a new message, and its
/// `courier-*` fields are dropped ([`Seal::open`]).
///
/// HMAC-SHA1, because Redis's scripts must check a seal too (a poison pill
/// is dead-lettered inside Redis) and SHA-1 is the one hash they have
/// (`redis.sha1hex`); an HMAC does not rely on the hash's collision
/// resistance, only on it being a pseudo-random function.
pub struct Seal {
    key: hmac::Key,
    secret: Vec<u8>,
}

impl std::fmt::Debug for Seal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Seal(..)")
    }
}

impl Seal {
    /// A seal with the key `secret` (as kept in the broker).
    pub fn new(secret: &[u8]) -> Result<Self, String> {
        if secret.is_empty() || secret.len() > 64 {
            return Err(format!(
                "a seal key is 1 to 64 bytes, this one is {}",
                secret.len()
            ));
        }
        Ok(Self {
            key: hmac::Key::new(hmac::HMAC_SHA1_FOR_LEGACY_USE_ONLY, secret),
            secret: secret.to_vec(),
        })
    }

    /// A new random key, as hex text, for a queue that has none yet.
    pub fn new_secret() -> String {
        let bytes: [u8; SEAL_KEY_BYTES] = rand::random();
        hex(&bytes)
    }

    /// The HMAC's inner and outer key blocks (`K ^ 0x36…`, `K ^ 0x5c…`),
    /// for a Redis script to compute the same seal with `redis.sha1hex`.
    pub fn pads(&self) -> (Vec<u8>, Vec<u8>) {
        let mut block = self.secret.clone();
        block.resize(64, 0);
        (
            block.iter().map(|b| b ^ 0x36).collect(),
            block.iter().map(|b| b ^ 0x5c).collect(),
        )
    }

    /// `fields` with a seal over their state, any older seal replaced.
    pub fn seal(&self, fields: Vec<(Bytes, Bytes)>) -> Vec<(Bytes, Bytes)> {
        let mut fields = without(fields, F_SEAL);
        let tag = hmac::sign(&self.key, &covered(&fields));
        fields.push((F_SEAL.into(), Bytes::from(hex(tag.as_ref()))));
        fields
    }

    /// Whether `fields` carry a valid seal over their state.
    pub fn is_sealed(&self, fields: &[(Bytes, Bytes)]) -> bool {
        let Some((_, tag)) = fields.iter().find(|(n, _)| n.as_ref() == F_SEAL.as_bytes()) else {
            return false;
        };
        unhex(tag).is_some_and(|tag| hmac::verify(&self.key, &covered(fields), &tag).is_ok())
    }

    /// The fields of a stored copy as courier may read them: a sealed copy
    /// as courier stored it, without the seal; anything else as a new
    /// message, without any `courier-*` field (a producer's, a dead-letter
    /// dump re-published by hand, or a copy an older courier stored without
    /// a seal). They are dropped, not kept as headers: the app never
    /// receives `Courier-*` headers from a producer anyway.
    pub fn open(&self, fields: Vec<(Bytes, Bytes)>) -> Vec<(Bytes, Bytes)> {
        if self.is_sealed(&fields) {
            return without(fields, F_SEAL);
        }
        let before = fields.len();
        let fields: Vec<_> = fields
            .into_iter()
            .filter(|(n, _)| !is_courier_field(n))
            .collect();
        if fields.len() != before {
            tracing::debug!(
                dropped = before - fields.len(),
                "a message carried courier-* fields without courier's seal: it is a new message and they are ignored"
            );
        }
        fields
    }
}

/// A `courier-*` field name, in any case.
pub fn is_courier_field(name: &[u8]) -> bool {
    name.len() >= 8 && name[..8].eq_ignore_ascii_case(b"courier-")
}

/// What a seal covers: each [`STATE_FIELDS`] field present (its first
/// value), as `name=<length>:value;`.
fn covered(fields: &[(Bytes, Bytes)]) -> Vec<u8> {
    let mut out = Vec::new();
    for name in STATE_FIELDS {
        if let Some((_, value)) = fields.iter().find(|(n, _)| n.as_ref() == name.as_bytes()) {
            out.extend_from_slice(format!("{name}={}:", value.len()).as_bytes());
            out.extend_from_slice(value);
            out.push(b';');
        }
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &[u8]) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    text.chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::shared::replace;

    fn stored() -> Vec<(Bytes, Bytes)> {
        vec![
            (Bytes::from("payload"), Bytes::from("x")),
            (Bytes::from("traceparent"), Bytes::from("00-a-b-01")),
            (Bytes::from(F_MESSAGE_ID), Bytes::from("1-0")),
            (Bytes::from(F_ATTEMPT), Bytes::from("2")),
        ]
    }

    #[test]
    fn a_sealed_copy_opens_as_it_was_stored() {
        let seal = Seal::new(Seal::new_secret().as_bytes()).unwrap();
        let sealed = seal.seal(stored());
        assert!(seal.is_sealed(&sealed));
        assert_eq!(seal.open(sealed), stored());
    }

    #[test]
    fn a_tampered_seal_is_rejected_and_the_state_dropped() {
        let seal = Seal::new(b"k1").unwrap();
        let sealed = seal.seal(stored());
        let without_state = vec![
            (Bytes::from("payload"), Bytes::from("x")),
            (Bytes::from("traceparent"), Bytes::from("00-a-b-01")),
        ];
        // The state changed after sealing (a forged attempt).
        let forged = replace(sealed.clone(), F_ATTEMPT, "99".into());
        assert!(!seal.is_sealed(&forged));
        assert_eq!(seal.open(forged), without_state);
        // A state field added after sealing.
        let mut added = sealed.clone();
        added.push((Bytes::from(F_REPLAYS), Bytes::from("7")));
        assert!(!seal.is_sealed(&added));
        // The seal itself altered, or not hex.
        for tag in ["00", "zz", ""] {
            let bad = replace(sealed.clone(), F_SEAL, tag.into());
            assert!(!seal.is_sealed(&bad), "{tag:?}");
        }
        // Another queue's key.
        assert!(!Seal::new(b"k2").unwrap().is_sealed(&sealed));
        // No seal at all: every courier-* field goes, in any case.
        let mut plain = stored();
        plain.push((Bytes::from("Courier-Deliveries"), Bytes::from("1000")));
        assert_eq!(seal.open(plain), without_state);
    }

    #[test]
    fn the_pads_are_the_hmac_key_blocks() {
        let seal = Seal::new(b"key").unwrap();
        let (inner, outer) = seal.pads();
        let data = covered(&stored());
        let sha1 = |data: &[u8]| {
            ring::digest::digest(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY, data)
                .as_ref()
                .to_vec()
        };
        let inner_hash = sha1(&[inner, data.clone()].concat());
        let tag = sha1(&[outer, inner_hash].concat());
        assert_eq!(tag, hmac::sign(&seal.key, &data).as_ref());
    }
}
