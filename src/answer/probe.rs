//! The shape of a plain chat completion, read straight off its bytes: the
//! same verdict as parsing the body into a `serde_json::Value` and looking
//! at it, without building that tree (only `usage` is kept as a value).
//!
//! Every value is still parsed in full by serde_json (strings checked as
//! UTF-8, numbers range-checked, nesting limited), so a body is JSON here
//! exactly when it is JSON to a `Value`; a key given twice counts by its last
//! value, as in a `Value`'s map.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// A whole body.
pub enum Top {
    NotAnObject,
    Object(Shape),
}

/// What the completion check looks at in an object.
#[derive(Default)]
pub struct Shape {
    /// An `error` member that is not `null`.
    pub error: bool,
    pub choices: Choices,
    pub usage: Option<Value>,
}

/// The `choices` member.
#[derive(Default)]
pub enum Choices {
    /// Missing, or not an array.
    #[default]
    Absent,
    Empty,
    /// An array whose element `first_bad` (if any) is not an object with an
    /// object `message`.
    Array {
        first_bad: Option<usize>,
    },
}

/// Visitor methods for the values a probe does not look into: each is
/// consumed (and so checked) and yields `$value`.
macro_rules! yield_for_others {
    ($value:expr) => {
        yield_for_others!($value, $value);
    };
    ($null:expr, $value:expr) => {
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($null)
        }
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok($value)
        }
    };
}

/// `$ty` read by `$visitor` from any JSON value.
macro_rules! read_with {
    ($ty:ty, $visitor:ident) => {
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<$ty, D::Error> {
                d.deserialize_any($visitor)
            }
        }

        struct $visitor;
    };
}

/// Any JSON value, parsed and dropped.
struct Any;

read_with!(Any, AnyVisitor);

impl<'de> Visitor<'de> for AnyVisitor {
    type Value = Any;
    yield_for_others!(Any);
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Any, A::Error> {
        drain_seq(seq).map(|_| Any)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Any, A::Error> {
        drain_map(map).map(|_| Any)
    }
}

fn drain_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<Any>()?.is_some() {}
    Ok(())
}

fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<Any, Any>()?.is_some() {}
    Ok(())
}

/// An object key, as far as the probes care.
enum Key {
    Error,
    Choices,
    Usage,
    Message,
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        d.deserialize_str(KeyVisitor)
    }
}

struct KeyVisitor;

impl Visitor<'_> for KeyVisitor {
    type Value = Key;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object key")
    }
    fn visit_str<E: de::Error>(self, key: &str) -> Result<Key, E> {
        Ok(match key {
            "error" => Key::Error,
            "choices" => Key::Choices,
            "usage" => Key::Usage,
            "message" => Key::Message,
            _ => Key::Other,
        })
    }
}

read_with!(Top, TopVisitor);

impl<'de> Visitor<'de> for TopVisitor {
    type Value = Top;
    yield_for_others!(Top::NotAnObject);
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Top, A::Error> {
        drain_seq(seq).map(|_| Top::NotAnObject)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Top, A::Error> {
        let mut shape = Shape::default();
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Error => shape.error = map.next_value::<NotNull>()?.0,
                Key::Choices => shape.choices = map.next_value::<Choices>()?,
                Key::Usage => shape.usage = Some(map.next_value::<Value>()?),
                Key::Message | Key::Other => {
                    map.next_value::<Any>()?;
                }
            }
        }
        Ok(Top::Object(shape))
    }
}

/// Whether a value is anything but `null`.
struct NotNull(bool);

read_with!(NotNull, NotNullVisitor);

impl<'de> Visitor<'de> for NotNullVisitor {
    type Value = NotNull;
    yield_for_others!(NotNull(false), NotNull(true));
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<NotNull, A::Error> {
        drain_seq(seq).map(|_| NotNull(true))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<NotNull, A::Error> {
        drain_map(map).map(|_| NotNull(true))
    }
}

read_with!(Choices, ChoicesVisitor);

impl<'de> Visitor<'de> for ChoicesVisitor {
    type Value = Choices;
    yield_for_others!(Choices::Absent);
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Choices, A::Error> {
        let (mut n, mut first_bad) = (0, None);
        while let Some(HasMessage(has)) = seq.next_element::<HasMessage>()? {
            if !has && first_bad.is_none() {
                first_bad = Some(n);
            }
            n += 1;
        }
        Ok(if n == 0 {
            Choices::Empty
        } else {
            Choices::Array { first_bad }
        })
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Choices, A::Error> {
        drain_map(map).map(|_| Choices::Absent)
    }
}

/// A choice: whether it is an object whose `message` is an object.
struct HasMessage(bool);

read_with!(HasMessage, HasMessageVisitor);

impl<'de> Visitor<'de> for HasMessageVisitor {
    type Value = HasMessage;
    yield_for_others!(HasMessage(false));
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<HasMessage, A::Error> {
        drain_seq(seq).map(|_| HasMessage(false))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<HasMessage, A::Error> {
        let mut has = false;
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Message => has = map.next_value::<IsObject>()?.0,
                _ => {
                    map.next_value::<Any>()?;
                }
            }
        }
        Ok(HasMessage(has))
    }
}

/// Whether a value is an object.
struct IsObject(bool);

read_with!(IsObject, IsObjectVisitor);

impl<'de> Visitor<'de> for IsObjectVisitor {
    type Value = IsObject;
    yield_for_others!(IsObject(false));
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<IsObject, A::Error> {
        drain_seq(seq).map(|_| IsObject(false))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<IsObject, A::Error> {
        drain_map(map).map(|_| IsObject(true))
    }
}
