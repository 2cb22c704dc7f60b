//! Where a config error is, said so that a person can act on it: the key
//! as one path (`routes[0].cache.ttl`), the line and column in the file,
//! or the environment variable that set it; a "did you mean" for a
//! misspelt key; the accepted form of a duration.

use std::ops::Range;

use toml_edit::{ImDocument, Item, Value};

/// A figment key path (`["routes", "0", "cache", "ttl"]`) as idem writes
/// keys in messages: `routes[0].cache.ttl`.
pub fn key_path<S: AsRef<str>>(path: &[S]) -> String {
    let mut out = String::new();
    for seg in path {
        let seg = seg.as_ref();
        if seg.parse::<usize>().is_ok() {
            out.push_str(&format!("[{seg}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(seg);
        }
    }
    out
}

/// The environment override that set `key` (`server.listen`), as
/// `IDEM_SERVER__LISTEN=value`: the variable is what to fix, not the file.
pub fn env_override(key: &str) -> Option<String> {
    env_override_in(std::env::vars(), key)
}

fn env_override_in(vars: impl Iterator<Item = (String, String)>, key: &str) -> Option<String> {
    vars.filter(|(name, _)| name.contains("__"))
        .find(|(name, _)| {
            name.strip_prefix("IDEM_").is_some_and(|rest| {
                let set = rest.to_ascii_lowercase().replace("__", ".");
                key == set
                    || key.starts_with(&format!("{set}."))
                    || key.starts_with(&format!("{set}["))
            })
        })
        .map(|(name, value)| format!("{name}={}", shown_value(key, &value)))
}

/// An override's value as an error may show it: never a client key, and
/// a URL without its password.
fn shown_value(key: &str, value: &str) -> String {
    if key.contains("api_keys") {
        super::REDACTED.to_string()
    } else {
        without_password(value)
    }
}

/// `line:column` (both from 1) of `key` in the TOML `text`: where the key
/// is written, or, when it is missing, where its nearest written ancestor
/// is.
pub fn locate(text: &str, key: &str) -> Option<(usize, usize)> {
    let doc = ImDocument::parse(text).ok()?;
    let segs = segments(key)?;
    let root = Item::Table(doc.as_table().clone());
    let span = span_of(&root, &segs, None)?;
    Some(line_col(text, span.start))
}

enum Seg<'a> {
    Key(&'a str),
    Index(usize),
}

/// `routes[0].cache.ttl` -> routes, 0, cache, ttl.
fn segments(key: &str) -> Option<Vec<Seg<'_>>> {
    let mut out = Vec::new();
    for part in key.split('.') {
        let (name, mut rest) = part.split_once('[').map_or((part, ""), |(n, r)| (n, r));
        if !name.is_empty() {
            out.push(Seg::Key(name));
        }
        while !rest.is_empty() {
            let (index, after) = rest.split_once(']')?;
            out.push(Seg::Index(index.parse().ok()?));
            rest = after.strip_prefix('[').unwrap_or(after);
        }
    }
    Some(out)
}

/// The span of the deepest part of `path` written under `item`.
fn span_of(item: &Item, path: &[Seg<'_>], found: Option<Range<usize>>) -> Option<Range<usize>> {
    let Some((seg, rest)) = path.split_first() else {
        return found;
    };
    match seg {
        Seg::Key(k) => match item.as_table_like().and_then(|t| t.get_key_value(k)) {
            Some((key, child)) => span_of(child, rest, key.span().or(found)),
            None => found,
        },
        Seg::Index(i) => match item {
            Item::ArrayOfTables(a) => match a.get(*i) {
                Some(t) => span_of(&Item::Table(t.clone()), rest, t.span().or(found)),
                None => found,
            },
            Item::Value(Value::Array(a)) => match a.get(*i) {
                Some(v) => span_of(&Item::Value(v.clone()), rest, v.span().or(found)),
                None => found,
            },
            _ => found,
        },
    }
}

/// 1-based line and column (in characters) of byte `offset`.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

/// The expected key closest to a misspelt one, if one is close enough to
/// be what was meant: a small edit away from the whole key or from its
/// last words (`timout` -> `request_timeout`).
pub fn did_you_mean<'a>(field: &str, expected: &[&'a str]) -> Option<&'a str> {
    let field = field.to_ascii_lowercase();
    let distance = |cand: &str| {
        let words: Vec<&str> = cand.split('_').collect();
        (0..words.len())
            .map(|i| strsim::damerau_levenshtein(&field, &words[i..].join("_")))
            .min()
            .unwrap_or(usize::MAX)
    };
    let limit = (field.chars().count() / 3).clamp(1, 3);
    expected
        .iter()
        .map(|c| (distance(c), *c))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// A URL with the password of its user info (`scheme://user:password@`)
/// replaced, for display.
pub fn without_password(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_string();
    };
    let rest = &url[scheme_end..];
    let Some(at) = rest.rfind('@') else {
        return url.to_string();
    };
    match rest[..at].find(':') {
        Some(colon) => format!(
            "{}{}:{}{}",
            &url[..scheme_end],
            &rest[..colon],
            super::REDACTED,
            &rest[at..]
        ),
        None => url.to_string(),
    }
}

/// What serde calls a duration, with the forms idem accepts.
pub const DURATION_FORMS: &str =
    "a duration: a number with a unit, such as \"30s\", \"500ms\", \"2m\" or \"1h\"";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_paths_index_arrays() {
        assert_eq!(
            key_path(&["routes", "0", "cache", "ttl"]),
            "routes[0].cache.ttl"
        );
        assert_eq!(key_path(&["server", "listen"]), "server.listen");
        assert_eq!(
            key_path(&["routes", "1", "targets", "0", "model"]),
            "routes[1].targets[0].model"
        );
    }

    #[test]
    fn keys_are_found_where_they_are_written() {
        let text = "[server]\nlisten = \"x\"\n\n[[routes]]\nmodel = \"a\"\n\n[[routes]]\nmodel = \"b\"\ntargets = [{ provider = \"p\", model = \"m\" }, { provider = \"q\", modle = \"n\" }]\n[routes.cache]\nttl = 5\n";
        assert_eq!(locate(text, "server.listen"), Some((2, 1)));
        assert_eq!(locate(text, "routes[1].model"), Some((8, 1)));
        assert_eq!(locate(text, "routes[1].cache.ttl"), Some((11, 1)));
        assert_eq!(locate(text, "routes[1].targets[1].modle"), Some((9, 63)));
        // Missing: the nearest ancestor that is written.
        assert_eq!(locate(text, "routes[0].targets"), Some((4, 1)));
        assert_eq!(locate(text, "nothing.here"), None);
        assert_eq!(locate("not toml [", "a"), None);
    }

    #[test]
    fn a_close_key_is_suggested_and_a_far_one_is_not() {
        let server = [
            "listen",
            "request_timeout",
            "body_timeout",
            "max_body_bytes",
        ];
        assert_eq!(did_you_mean("lisen", &server), Some("listen"));
        assert_eq!(did_you_mean("timout", &server), Some("request_timeout"));
        assert_eq!(
            did_you_mean("max_body_byte", &server),
            Some("max_body_bytes")
        );
        assert_eq!(did_you_mean("colour", &server), None);
    }

    #[test]
    fn passwords_leave_urls() {
        assert_eq!(
            without_password("postgres://idem:s3cret@db:5432/idem"),
            "postgres://idem:<redacted>@db:5432/idem"
        );
        assert_eq!(
            without_password("redis://:s3cret@127.0.0.1:6379"),
            "redis://:<redacted>@127.0.0.1:6379"
        );
        assert_eq!(without_password("sqlite://idem.db"), "sqlite://idem.db");
        assert_eq!(without_password("memory"), "memory");
        assert_eq!(
            without_password("postgres://idem@db/idem"),
            "postgres://idem@db/idem"
        );
    }

    #[test]
    fn an_override_is_found_by_its_key() {
        let vars = || {
            [
                ("IDEM_SERVER__LISTEN".to_string(), "notanaddr".to_string()),
                ("IDEM_CONFIG".to_string(), "x".to_string()),
            ]
            .into_iter()
        };
        assert_eq!(
            env_override_in(vars(), "server.listen").as_deref(),
            Some("IDEM_SERVER__LISTEN=notanaddr")
        );
        assert_eq!(env_override_in(vars(), "server.listener"), None);
        // Secrets stay out of the message.
        let secret = || {
            [
                (
                    "IDEM_ADMIN__API_KEYS".to_string(),
                    "[\"short\"]".to_string(),
                ),
                (
                    "IDEM_STORAGE__URL".to_string(),
                    "postgres://u:pw@h/db".to_string(),
                ),
            ]
            .into_iter()
        };
        assert_eq!(
            env_override_in(secret(), "admin.api_keys[0]").as_deref(),
            Some("IDEM_ADMIN__API_KEYS=<redacted>")
        );
        assert_eq!(
            env_override_in(secret(), "storage.url").as_deref(),
            Some("IDEM_STORAGE__URL=postgres://u:<redacted>@h/db")
        );
        assert_eq!(env_override_in(vars(), "config"), None);
    }
}
