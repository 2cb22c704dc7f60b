//! Opaque tokens the mock hands out and checks when a client sends them
//! back: a thinking block's `signature` (Anthropic), a reasoning item's
//! `encrypted_content` (OpenAI's Responses API), a search result's
//! `encrypted_content`. Each is a base64 text holding the sealed payload and
//! a keyed BLAKE3 tag over it, so that the mock can tell its own tokens from
//! tampered or foreign ones without keeping anything: as the real APIs
//! refuse a thinking block whose signature does not match, or reasoning
//! they cannot decrypt. The key is fixed, so tokens stay valid across
//! restarts of the mock (a test double has nothing to keep secret).

use base64::Engine;
use base64::engine::general_purpose::STANDARD;

/// The key of the tags; fixed, see the module's documentation.
const KEY: [u8; 32] = *b"idem mock upstream: seal key v1.";

/// The bytes of a tag.
const TAG_BYTES: usize = 32;

/// `payload` sealed for `purpose` (a token of one purpose does not open as
/// another).
pub(crate) fn seal(purpose: &str, payload: &str) -> String {
    let tag = tag(purpose, payload.as_bytes());
    let mut bytes = Vec::with_capacity(TAG_BYTES + payload.len());
    bytes.extend_from_slice(&tag);
    bytes.extend_from_slice(payload.as_bytes());
    STANDARD.encode(bytes)
}

/// The payload of a token that [`seal`] made for `purpose`; `None` for
/// anything else (not base64, too short, a wrong tag, not UTF-8).
pub(crate) fn open(purpose: &str, token: &str) -> Option<String> {
    let bytes = STANDARD.decode(token.trim()).ok()?;
    if bytes.len() < TAG_BYTES {
        return None;
    }
    let (sent, payload) = bytes.split_at(TAG_BYTES);
    let expected = tag(purpose, payload);
    // Not constant-time: nothing here is secret.
    if sent != expected.as_slice() {
        return None;
    }
    String::from_utf8(payload.to_vec()).ok()
}

fn tag(purpose: &str, payload: &[u8]) -> [u8; TAG_BYTES] {
    let mut hasher = blake3::Hasher::new_keyed(&KEY);
    hasher.update(purpose.as_bytes());
    hasher.update(&[0]);
    hasher.update(payload);
    *hasher.finalize().as_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_payload_opens_for_its_purpose_only() {
        let token = seal("thinking", "mock thinking #1");
        assert_eq!(
            open("thinking", &token).as_deref(),
            Some("mock thinking #1")
        );
        assert_eq!(open("reasoning", &token), None);
        assert_eq!(seal("thinking", "mock thinking #1"), token, "deterministic");
    }

    #[test]
    fn a_tampered_or_foreign_token_does_not_open() {
        let token = seal("thinking", "abc");
        let mut bytes = STANDARD.decode(&token).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        assert_eq!(open("thinking", &STANDARD.encode(&bytes)), None);
        assert_eq!(open("thinking", "not base64 at all!"), None);
        assert_eq!(open("thinking", "c2hvcnQ="), None);
        assert_eq!(open("thinking", ""), None);
    }
}
