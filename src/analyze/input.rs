//! Reading `idem analyze`'s input: JSON lines that are either request-log
//! lines (they have a `fingerprint`) or raw OpenAI request bodies (they
//! have `messages`), reduced to one small [`Event`] per request.
//!
//! This is the hot loop of the command (millions of lines), so a line is
//! parsed once into a borrowed [`Probe`] that names only the fields used,
//! strings are interned, and the fingerprint text becomes 32 bytes: a
//! request costs one `Event` and no allocation once its tenant, route and
//! fingerprint have been seen. Raw bodies are the slow path: they are parsed
//! whole and fingerprinted with a route's rules, as the gateway would.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::io::BufRead;

use serde::de::{self, Deserializer, IgnoredAny, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::text::TextLine;
use crate::config::{Config, Normalize, RouteConfig, Scope};
use crate::fingerprint::{self, Fingerprint, Rules};
use crate::prices::Price;

/// One request, as the simulation needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// Index of its (tenant, fingerprint) group.
    pub group: u32,
    /// Arrival, microseconds since the Unix epoch (0 when the line has no
    /// time; see [`Counts::untimed`]).
    pub time_us: i64,
    /// The line's `upstream_ms` in microseconds; 0 when absent.
    pub upstream_us: u64,
    /// Whether an answer with the line's status enters the result cache
    /// (status below 400, or no status).
    pub cacheable: bool,
    /// Input order, to break ties between equal times.
    pub seq: u32,
    /// The tokens of the line's answer (`prompt_tokens`,
    /// `completion_tokens`); 0 when absent.
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// Its price: an index into [`Collector::prices`], or [`NO_PRICE`].
    pub price: u32,
}

/// Who answered a line: its route, provider and model.
type Answerer = (Box<str>, Box<str>, Box<str>);

/// An [`Event`] whose answer has no known price.
pub const NO_PRICE: u32 = u32::MAX;

/// A (tenant, fingerprint) pair: requests that would share a call.
#[derive(Debug, Clone)]
pub struct Group {
    pub tenant: u32,
    pub route: u32,
    pub fingerprint: [u8; 32],
    /// The fingerprint as written, when it is not `v1:<64 hex>` (then
    /// `fingerprint` is a hash of this text).
    pub text: Option<Box<str>>,
    pub requests: u64,
}

/// One endpoint's requests (`chat`, `messages`, `responses`, `embeddings`,
/// `jobs`: the log's `endpoint`; a line without one, or a raw body, is
/// `chat`).
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct EndpointCounts {
    pub requests: u64,
    /// Distinct (tenant, fingerprint) pairs first seen on this endpoint
    /// (a fingerprint names its face, so a task belongs to one).
    pub distinct_tasks: u64,
    /// Log lines answered without a call of their own (`follower`,
    /// `cache-hit`, `negative-hit`, `replay`).
    pub saved: u64,
}

/// How the input's lines were read.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Counts {
    /// Non-empty lines read.
    pub lines: u64,
    /// Request-log lines analysed.
    pub log_lines: u64,
    /// Raw request bodies analysed.
    pub raw_bodies: u64,
    /// JSON lines that are neither (other log events).
    pub other_lines: u64,
    /// Lines that are neither JSON objects nor lines of the text log.
    pub unreadable_lines: u64,
    /// Request lines of another route than `--route`.
    pub other_routes: u64,
    /// Requests without a readable `time` or `timestamp`.
    pub untimed: u64,
}

/// What raw bodies are fingerprinted with.
#[derive(Debug, Clone, Default)]
pub struct RawRules {
    /// Routes by public model name (from `--config`).
    pub config: Option<Config>,
    /// `--route`: these rules for every body, whatever its `model`.
    pub route: Option<String>,
    /// The tenant of every body.
    pub tenant: String,
    /// `--input-price` and `--output-price`: every line's price, over the
    /// config's and the built-in ones.
    pub price: Option<Price>,
}

/// Accumulates events from any number of inputs.
#[derive(Debug, Default)]
pub struct Collector {
    pub counts: Counts,
    pub events: Vec<Event>,
    pub groups: Vec<Group>,
    pub tenants: Vec<Box<str>>,
    pub routes: Vec<Box<str>>,
    /// `outcome` values of log lines and how often each was seen.
    pub outcomes: HashMap<Box<str>, u64>,
    /// The endpoints lines named, and the requests of each (same order).
    pub endpoints: Vec<Box<str>>,
    pub by_endpoint: Vec<EndpointCounts>,
    endpoint_ids: HashMap<Box<str>, u32>,
    /// `upstream_ms` of lines that made their own call (`leader`, `bypass`),
    /// in microseconds.
    pub leader_upstream_us: Vec<u64>,
    /// The prices lines named, by [`Event::price`].
    pub prices: Vec<Price>,
    price_ids: HashMap<Answerer, u32>,
    by_key: HashMap<(u32, [u8; 32]), u32>,
    tenant_ids: HashMap<Box<str>, u32>,
    route_ids: HashMap<Box<str>, u32>,
    /// `--route` for log lines: only this route's lines count.
    only_route: Option<String>,
    raw: RawRules,
}

/// The fields of a line that `idem analyze` reads; everything else is
/// skipped without being built.
#[derive(Deserialize)]
struct Probe<'a> {
    #[serde(borrow, default)]
    time: Option<TimeValue<'a>>,
    #[serde(borrow, default)]
    timestamp: Option<TimeValue<'a>>,
    #[serde(borrow, default)]
    tenant: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    route: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    endpoint: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    fingerprint: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    outcome: Option<Cow<'a, str>>,
    #[serde(default)]
    status: Option<u64>,
    #[serde(default)]
    upstream_ms: Option<f64>,
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(borrow, default)]
    provider: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    messages: Option<IgnoredAny>,
}

/// A `time` or `timestamp` field: RFC 3339 text or a Unix time number.
enum TimeValue<'a> {
    Text(Cow<'a, str>),
    Number(f64),
}

impl<'de: 'a, 'a> Deserialize<'de> for TimeValue<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = TimeValue<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an RFC 3339 time or a Unix time")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(TimeValue::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(TimeValue::Text(Cow::Owned(v.to_string())))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                Ok(TimeValue::Number(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(TimeValue::Number(v as f64))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(TimeValue::Number(v as f64))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

impl TimeValue<'_> {
    fn micros(&self) -> Option<i64> {
        match self {
            TimeValue::Text(t) => parse_rfc3339_us(t),
            TimeValue::Number(n) => unix_number_us(*n),
        }
    }
}

fn json_time_us(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => parse_rfc3339_us(s),
        Value::Number(n) => n.as_f64().and_then(unix_number_us),
        _ => None,
    }
}

/// A Unix time number: seconds, or milliseconds from 10^11 on, or
/// microseconds from 10^14 on (10^11 seconds would be the year 5138).
fn unix_number_us(n: f64) -> Option<i64> {
    if !n.is_finite() || n < 0.0 {
        return None;
    }
    let us = if n >= 1e14 {
        n
    } else if n >= 1e11 {
        n * 1e3
    } else {
        n * 1e6
    };
    (us < 9.0e18).then_some(us.round() as i64)
}

/// Parses RFC 3339 (`2025-03-01T09:00:00.123Z`, `...+02:00`; a space may
/// stand for the `T`) into microseconds since the Unix epoch.
pub fn parse_rfc3339_us(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let mut n = 0i64;
        for &c in b.get(r)? {
            if !c.is_ascii_digit() {
                return None;
            }
            n = n * 10 + i64::from(c - b'0');
        }
        Some(n)
    };
    if b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 {
        return None;
    }
    if second > 60 {
        return None;
    }
    let mut i = 19;
    let mut micros = 0i64;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            if i - start < 6 {
                micros = micros * 10 + i64::from(b[i] - b'0');
            }
            i += 1;
        }
        let digits = i - start;
        if digits == 0 {
            return None;
        }
        for _ in digits..6 {
            micros *= 10;
        }
    }
    let offset_s = match b.get(i)? {
        b'Z' | b'z' if i + 1 == b.len() => 0,
        sign @ (b'+' | b'-') if i + 6 == b.len() && b[i + 3] == b':' => {
            let o = num(i + 1..i + 3)? * 3600 + num(i + 4..i + 6)? * 60;
            if *sign == b'+' { o } else { -o }
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second - offset_s;
    Some(secs * 1_000_000 + micros)
}

/// Days since 1970-01-01 of a proleptic Gregorian date.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The 32 bytes that identify a fingerprint's text.
fn fingerprint_key(text: &str) -> ([u8; 32], bool) {
    match text.parse::<Fingerprint>() {
        Ok(fp) => (*fp.as_bytes(), true),
        Err(_) => (*blake3::hash(text.as_bytes()).as_bytes(), false),
    }
}

fn intern(ids: &mut HashMap<Box<str>, u32>, names: &mut Vec<Box<str>>, name: &str) -> u32 {
    if let Some(&id) = ids.get(name) {
        return id;
    }
    let id = u32::try_from(names.len()).unwrap_or(u32::MAX);
    names.push(name.into());
    ids.insert(name.into(), id);
    id
}

impl Collector {
    pub fn new(only_route: Option<String>, raw: RawRules) -> Collector {
        Collector {
            only_route,
            raw,
            ..Collector::default()
        }
    }

    /// Reads JSON lines until the end of `input`. `progress` is told the
    /// bytes consumed now and then.
    pub fn read(
        &mut self,
        mut input: impl BufRead,
        mut progress: impl FnMut(u64),
    ) -> std::io::Result<()> {
        let mut line = Vec::with_capacity(1024);
        let mut bytes = 0u64;
        loop {
            line.clear();
            let n = input.read_until(b'\n', &mut line)?;
            if n == 0 {
                break;
            }
            bytes += n as u64;
            self.line(&line);
            if self.counts.lines.is_multiple_of(16_384) {
                progress(bytes);
            }
        }
        progress(bytes);
        Ok(())
    }

    /// One line of input.
    pub fn line(&mut self, line: &[u8]) {
        if line.iter().all(u8::is_ascii_whitespace) {
            return;
        }
        self.counts.lines += 1;
        // The default log's text form: its request lines, as JSON.
        if line.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            match super::text::parse(line) {
                Some(TextLine::Request(fields)) => match serde_json::to_vec(&fields) {
                    Ok(json) => self.json_line(&json),
                    Err(_) => self.counts.unreadable_lines += 1,
                },
                Some(TextLine::Other) => self.counts.other_lines += 1,
                None => self.json_line(line),
            }
            return;
        }
        self.json_line(line);
    }

    /// One line of JSON (or what should be).
    fn json_line(&mut self, line: &[u8]) {
        match serde_json::from_slice::<Probe>(line) {
            Ok(p) if p.fingerprint.is_some() => self.log_line(p),
            Ok(p) if p.messages.is_some() => self.raw_line(line),
            Ok(_) => self.counts.other_lines += 1,
            // A raw body may carry a field the probe reads with another
            // type (a `status` string, say): try it whole.
            Err(_) => self.raw_line(line),
        }
    }

    fn log_line(&mut self, p: Probe<'_>) {
        let route = p.route.as_deref().unwrap_or("");
        if self.only_route.as_deref().is_some_and(|r| r != route) {
            self.counts.other_routes += 1;
            return;
        }
        self.counts.log_lines += 1;
        let time = p.time.as_ref().or(p.timestamp.as_ref());
        let time_us = time.and_then(TimeValue::micros);
        let upstream_us = match p.upstream_ms {
            Some(ms) if ms.is_finite() && ms > 0.0 => (ms * 1000.0).round() as u64,
            _ => 0,
        };
        if let Some(outcome) = p.outcome.as_deref() {
            match self.outcomes.get_mut(outcome) {
                Some(n) => *n += 1,
                None => {
                    self.outcomes.insert(outcome.into(), 1);
                }
            }
            if matches!(outcome, "leader" | "bypass") && upstream_us > 0 {
                self.leader_upstream_us.push(upstream_us);
            }
        }
        let text = p.fingerprint.as_deref().unwrap_or("");
        let (key, parsed) = fingerprint_key(text);
        let odd_text = (!parsed).then_some(text);
        let tenant = p.tenant.as_deref().unwrap_or("");
        let cacheable = p.status.is_none_or(|s| s < 400);
        let price = self.price_id(
            route,
            p.provider.as_deref().unwrap_or(""),
            p.model.as_deref().unwrap_or(""),
        );
        let tokens = |n: Option<u64>| u32::try_from(n.unwrap_or(0)).unwrap_or(u32::MAX);
        let groups = self.groups.len();
        let saved = matches!(
            p.outcome.as_deref(),
            Some("follower" | "cache-hit" | "negative-hit" | "replay")
        );
        let endpoint = self.endpoint(p.endpoint.as_deref().unwrap_or("chat"));
        endpoint.requests += 1;
        endpoint.saved += u64::from(saved);
        self.push(
            tenant,
            route,
            key,
            odd_text,
            time_us,
            upstream_us,
            cacheable,
        );
        if self.groups.len() > groups {
            self.endpoint(p.endpoint.as_deref().unwrap_or("chat"))
                .distinct_tasks += 1;
        }
        if let Some(e) = self.events.last_mut() {
            e.input_tokens = tokens(p.prompt_tokens);
            e.output_tokens = tokens(p.completion_tokens);
            e.price = price;
        }
    }

    /// The price of an answer from `provider`'s `model` on `route`: the
    /// flags' price, else the config's target's (its own or the built-in
    /// one of its model), else the built-in price of the model's name.
    fn price_id(&mut self, route: &str, provider: &str, model: &str) -> u32 {
        let key = (route.into(), provider.into(), model.into());
        if let Some(id) = self.price_ids.get(&key) {
            return *id;
        }
        let configured = || {
            let config = self.raw.config.as_ref()?;
            let target = config
                .routes
                .iter()
                .find(|r| r.model == route)?
                .targets
                .iter()
                .find(|t| t.provider == provider && t.model == model)?;
            let kind = config.provider(provider)?.kind;
            Price::of_target(target.price.as_ref(), kind, model)
        };
        let price = self
            .raw
            .price
            .or_else(configured)
            .or_else(|| crate::prices::built_in_by_name(model));
        let id = match price {
            Some(p) => {
                self.prices.push(p);
                u32::try_from(self.prices.len() - 1).unwrap_or(NO_PRICE)
            }
            None => NO_PRICE,
        };
        self.price_ids.insert(key, id);
        id
    }

    fn raw_line(&mut self, line: &[u8]) {
        let Ok(Value::Object(mut body)) = serde_json::from_slice::<Value>(line) else {
            self.counts.unreadable_lines += 1;
            return;
        };
        if !body.contains_key("messages") {
            self.counts.other_lines += 1;
            return;
        }
        // `time` and `timestamp` annotate the line; they are not part of
        // the request (and `time` would otherwise join the fingerprint).
        let time = body.remove("time");
        let stamp = body.remove("timestamp");
        let time_us = time.as_ref().or(stamp.as_ref()).and_then(json_time_us);
        let model = body
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let fp = self.raw_fingerprint(&body, &model);
        let route = self.raw.route.clone().unwrap_or(model);
        self.counts.raw_bodies += 1;
        let tenant = self.raw.tenant.clone();
        let groups = self.groups.len();
        self.endpoint("chat").requests += 1;
        self.push(&tenant, &route, *fp.as_bytes(), None, time_us, 0, true);
        if self.groups.len() > groups {
            self.endpoint("chat").distinct_tasks += 1;
        }
    }

    /// The counts of `name`'s requests.
    fn endpoint(&mut self, name: &str) -> &mut EndpointCounts {
        let id = intern(&mut self.endpoint_ids, &mut self.endpoints, name) as usize;
        if self.by_endpoint.len() <= id {
            self.by_endpoint.resize(id + 1, EndpointCounts::default());
        }
        &mut self.by_endpoint[id]
    }

    /// The fingerprint the gateway would compute for `body` on its route;
    /// without a configured route: the default rules (no targets, no
    /// normalization, tenant scope) under the body's `model`.
    fn raw_fingerprint(&self, body: &Map<String, Value>, model: &str) -> Fingerprint {
        let name = self.raw.route.as_deref().unwrap_or(model);
        let route: Option<&RouteConfig> = self
            .raw
            .config
            .as_ref()
            .and_then(|c| c.routes.iter().find(|r| r.model == name));
        let rules = match route {
            Some(r) => Rules {
                tenant: &self.raw.tenant,
                route: &r.model,
                targets: &r.targets,
                kinds: &[],
                normalize: r.normalize,
                scope: r.scope,
                ignore_fields: &r.ignore_fields,
                // One route's requests share its contract: grouping is the
                // same with or without it.
                contract: None,
                dialect: crate::dialect::Dialect::Chat,
                headers: &crate::fingerprint::NO_HEADERS,
            },
            None => Rules {
                tenant: &self.raw.tenant,
                route: name,
                targets: &[],
                kinds: &[],
                normalize: Normalize::None,
                scope: Scope::Tenant,
                ignore_fields: &[],
                contract: None,
                dialect: crate::dialect::Dialect::Chat,
                headers: &crate::fingerprint::NO_HEADERS,
            },
        };
        fingerprint::fingerprint(body, None, &rules)
    }

    /// Records one request. `odd_text`: the fingerprint as written when it
    /// is not `v1:<hex>` (`key` is then its hash).
    #[expect(clippy::too_many_arguments, reason = "one request's fields")]
    fn push(
        &mut self,
        tenant: &str,
        route: &str,
        key: [u8; 32],
        odd_text: Option<&str>,
        time_us: Option<i64>,
        upstream_us: u64,
        cacheable: bool,
    ) {
        let tenant = intern(&mut self.tenant_ids, &mut self.tenants, tenant);
        let next = u32::try_from(self.groups.len()).unwrap_or(u32::MAX);
        let group = *self.by_key.entry((tenant, key)).or_insert(next);
        if group == next {
            let route = intern(&mut self.route_ids, &mut self.routes, route);
            self.groups.push(Group {
                tenant,
                route,
                fingerprint: key,
                text: odd_text.map(Into::into),
                requests: 0,
            });
        }
        if let Some(g) = self.groups.get_mut(group as usize) {
            g.requests += 1;
        }
        if time_us.is_none() {
            self.counts.untimed += 1;
        }
        let seq = u32::try_from(self.events.len()).unwrap_or(u32::MAX);
        self.events.push(Event {
            group,
            time_us: time_us.unwrap_or(0),
            upstream_us,
            cacheable,
            seq,
            input_tokens: 0,
            output_tokens: 0,
            price: NO_PRICE,
        });
    }

    /// The fingerprint of a group as text.
    pub fn fingerprint_text(&self, g: &Group) -> String {
        match &g.text {
            Some(t) => t.to_string(),
            None => Fingerprint::from_bytes(g.fingerprint).to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_times_with_fractions_and_offsets() {
        assert_eq!(parse_rfc3339_us("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_rfc3339_us("1970-01-01T00:00:01.5Z"), Some(1_500_000));
        assert_eq!(
            parse_rfc3339_us("2025-03-01T10:00:00.123456789+01:00"),
            parse_rfc3339_us("2025-03-01T09:00:00.123456Z")
        );
        let t = humantime::parse_rfc3339("2024-02-29T23:59:59.250Z").unwrap();
        let us = t.duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as i64;
        assert_eq!(parse_rfc3339_us("2024-02-29T23:59:59.250Z"), Some(us));
        assert_eq!(parse_rfc3339_us("2024-02-29 23:59:59.250Z"), Some(us));
        for bad in [
            "",
            "yesterday",
            "2024-13-01T00:00:00Z",
            "2024-01-01T00:00:00",
        ] {
            assert_eq!(parse_rfc3339_us(bad), None, "{bad}");
        }
    }

    #[test]
    fn unix_numbers_in_seconds_milliseconds_or_microseconds() {
        assert_eq!(unix_number_us(1.5), Some(1_500_000));
        assert_eq!(unix_number_us(1_700_000_000.0), Some(1_700_000_000_000_000));
        assert_eq!(
            unix_number_us(1_700_000_000_123.0),
            Some(1_700_000_000_123_000)
        );
        assert_eq!(
            unix_number_us(1_700_000_000_123_456.0),
            Some(1_700_000_000_123_456)
        );
        assert_eq!(unix_number_us(-1.0), None);
    }

    #[test]
    fn log_lines_raw_bodies_and_other_lines() {
        let mut c = Collector::new(
            None,
            RawRules {
                tenant: "default".into(),
                ..RawRules::default()
            },
        );
        let fp = Fingerprint::from_bytes([3; 32]);
        c.line(format!(r#"{{"time":"2025-01-01T00:00:00.000Z","tenant":"a","route":"bot","fingerprint":"{fp}","outcome":"leader","status":200,"upstream_ms":120.5}}"#).as_bytes());
        c.line(
            br#"{"timestamp":"2025-01-01T00:00:00Z","level":"INFO","message":"idem listening"}"#,
        );
        // The text log's own lines are other lines; anything else unreadable.
        c.line(b"2025-01-01T00:00:00Z INFO idem listening");
        c.line(b"not a log line");
        c.line(b"   \n");
        c.line(br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"time":1735689600}"#);
        c.line(br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"time":1735689601}"#);
        // A field the probe reads with another type: read whole, and (an
        // unknown field) part of the fingerprint.
        c.line(br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"status":"x"}"#);
        assert_eq!(c.counts.lines, 7);
        assert_eq!(c.counts.log_lines, 1);
        assert_eq!(c.counts.raw_bodies, 3);
        assert_eq!(c.counts.other_lines, 2);
        assert_eq!(c.counts.unreadable_lines, 1);
        assert_eq!(c.counts.untimed, 1);
        assert_eq!(c.groups.len(), 3, "the first two raw bodies are one task");
        assert_eq!(c.events[0].upstream_us, 120_500);
        assert_eq!(c.leader_upstream_us, [120_500]);
        assert_eq!(c.events[2].time_us - c.events[1].time_us, 1_000_000);
        assert_eq!(c.fingerprint_text(&c.groups[0]), fp.to_string());
    }

    #[test]
    fn raw_bodies_use_the_route_rules_of_the_config() {
        let config = Config::from_toml_str(
            "[[providers]]\nname=\"p\"\nkind=\"mock\"\n[[routes]]\nmodel=\"faq\"\nnormalize=\"casefold\"\ntargets=[{provider=\"p\",model=\"x\"}]\n",
            crate::config::Source::Embedded,
            false,
        )
        .unwrap();
        let mut c = Collector::new(
            None,
            RawRules {
                config: Some(config),
                route: None,
                tenant: "acme".into(),
                price: None,
            },
        );
        c.line(br#"{"model":"faq","messages":[{"role":"user","content":"Where is my order?"}]}"#);
        c.line(br#"{"model":"faq","messages":[{"role":"user","content":"where  is my ORDER?"}]}"#);
        c.line(
            br#"{"model":"other","messages":[{"role":"user","content":"where  is my ORDER?"}]}"#,
        );
        assert_eq!(c.groups.len(), 2, "casefold merges the first two");
        assert_eq!(c.counts.untimed, 3);
        assert_eq!(&*c.routes[c.groups[1].route as usize], "other");
        assert_eq!(&*c.tenants[0], "acme");
    }
}
