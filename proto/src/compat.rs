//! The API's compatibility promise, tested: a field's number and name, and an enum value's
//! number and name, are never reused for something else. `proto/api-v1.lock` lists every one
//! released (one line each, `Message.field = N`, `Enum.VALUE = N`); the descriptor built from
//! today's `.proto` must hold each line as it is, or reserve both its number and its name.
//! A new field is added to the lock in the same change (`UBLKD_BLESS=1 cargo test -p
//! ublkd-proto compat` writes it; the diff is then reviewed like any other).

use prost::Message;
use prost_types::{DescriptorProto, FileDescriptorSet};
use std::collections::{BTreeMap, BTreeSet};

/// Where the lock lives, beside the `.proto`.
const LOCK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/api-v1.lock");

/// One numbered name of the API: a message's field or an enum's value.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    /// `Message.field`, `Message.Nested.field` or `Enum.VALUE`.
    path: String,
    number: i32,
}

/// What a message or enum gives up: reserved numbers and names.
#[derive(Debug, Default)]
struct Reserved {
    numbers: Vec<(i32, i32)>,
    names: BTreeSet<String>,
}

/// Every entry of the API, and what each scope (message or enum, by path) reserves.
fn today() -> (Vec<Entry>, BTreeMap<String, Reserved>) {
    let set = FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET).expect("the API's descriptor");
    let (mut entries, mut reserved) = (Vec::new(), BTreeMap::new());
    for file in &set.file {
        for m in &file.message_type {
            message(m, "", &mut entries, &mut reserved);
        }
        for e in &file.enum_type {
            let scope = e.name().to_owned();
            for v in &e.value {
                entries.push(Entry {
                    path: format!("{scope}.{}", v.name()),
                    number: v.number(),
                });
            }
            let r: &mut Reserved = reserved.entry(scope).or_default();
            // Enum ranges are inclusive; messages' are exclusive at the end.
            r.numbers
                .extend(e.reserved_range.iter().map(|x| (x.start(), x.end() + 1)));
            r.names.extend(e.reserved_name.iter().cloned());
        }
    }
    entries.sort();
    (entries, reserved)
}

fn message(
    m: &DescriptorProto,
    outer: &str,
    entries: &mut Vec<Entry>,
    reserved: &mut BTreeMap<String, Reserved>,
) {
    let scope = format!("{outer}{}", m.name());
    for f in &m.field {
        entries.push(Entry {
            path: format!("{scope}.{}", f.name()),
            number: f.number(),
        });
    }
    for e in &m.enum_type {
        for v in &e.value {
            entries.push(Entry {
                path: format!("{scope}.{}.{}", e.name(), v.name()),
                number: v.number(),
            });
        }
    }
    let r = reserved.entry(scope.clone()).or_default();
    r.numbers
        .extend(m.reserved_range.iter().map(|x| (x.start(), x.end())));
    r.names.extend(m.reserved_name.iter().cloned());
    for nested in &m.nested_type {
        // Map entries are the compiler's, not the API's.
        if nested.options.as_ref().is_some_and(|o| o.map_entry()) {
            continue;
        }
        message(nested, &format!("{scope}."), entries, reserved);
    }
}

fn lock_text(entries: &[Entry]) -> String {
    let mut text = String::from(
        "# Every field and enum value the API has released: never renumbered, never reused\n\
         # (proto/src/compat.rs). Removing one means reserving its number and name.\n",
    );
    for e in entries {
        text.push_str(&format!("{} = {}\n", e.path, e.number));
    }
    text
}

fn parse_lock(text: &str) -> Vec<Entry> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (path, number) = l.split_once(" = ").expect("PATH = NUMBER");
            Entry {
                path: path.to_owned(),
                number: number.parse().expect("a number"),
            }
        })
        .collect()
}

/// What is wrong with `now` against the `locked` entries: each broken promise, then each new
/// entry the lock lacks.
fn judge(
    locked: &[Entry],
    now: &[Entry],
    reserved: &BTreeMap<String, Reserved>,
) -> (Vec<String>, Vec<String>) {
    let mut broken = Vec::new();
    for old in locked {
        if now.contains(old) {
            continue;
        }
        let (scope, name) = old.path.rsplit_once('.').expect("SCOPE.NAME");
        let r = reserved.get(scope);
        let number_kept =
            r.is_some_and(|r| r.numbers.iter().any(|&(a, b)| (a..b).contains(&old.number)));
        let name_kept = r.is_some_and(|r| r.names.contains(name));
        let reused = now
            .iter()
            .filter(|e| e.path.rsplit_once('.').is_some_and(|(s, _)| s == scope))
            .find(|e| e.number == old.number || e.path == old.path);
        match reused {
            Some(e) => broken.push(format!(
                "{} = {} is now {} = {}",
                old.path, old.number, e.path, e.number
            )),
            None if !(number_kept && name_kept) => broken.push(format!(
                "{} = {} is gone without `reserved {};` and `reserved \"{name}\";`",
                old.path, old.number, old.number
            )),
            None => {}
        }
    }
    let new = now
        .iter()
        .filter(|e| !locked.contains(e))
        .filter(|e| {
            !locked.iter().any(|o| {
                o.path == e.path || {
                    let same_scope = o.path.rsplit_once('.').map(|x| x.0)
                        == e.path.rsplit_once('.').map(|x| x.0);
                    same_scope && o.number == e.number
                }
            })
        })
        .map(|e| format!("{} = {}", e.path, e.number))
        .collect();
    (broken, new)
}

#[test]
fn no_released_field_or_value_is_renumbered_or_reused() {
    let (now, reserved) = today();
    if std::env::var_os("UBLKD_BLESS").is_some() {
        std::fs::write(LOCK, lock_text(&now)).expect("writing the lock");
    }
    let locked = parse_lock(&std::fs::read_to_string(LOCK).expect("proto/api-v1.lock"));
    let (broken, new) = judge(&locked, &now, &reserved);
    assert!(
        broken.is_empty(),
        "compatibility broken:\n{}",
        broken.join("\n")
    );
    assert!(
        new.is_empty(),
        "new fields or values not yet in proto/api-v1.lock (UBLKD_BLESS=1 adds them):\n{}",
        new.join("\n")
    );
}

/// The judge itself: a renumbered field, a reused number, a removal with and without its
/// reservation, and an addition.
#[test]
fn the_judge_sees_each_way_a_promise_breaks() {
    let e = |path: &str, number| Entry {
        path: path.into(),
        number,
    };
    let locked = [e("M.a", 1), e("M.b", 2), e("M.c", 3)];
    let mut reserved = BTreeMap::new();
    reserved.insert("M".to_owned(), Reserved::default());
    // b renumbered to 4, c's number given to d
    let (broken, _) = judge(&locked, &[e("M.a", 1), e("M.b", 4), e("M.d", 3)], &reserved);
    assert_eq!(broken.len(), 2, "{broken:?}");
    // c removed without a reservation
    let (broken, _) = judge(&locked, &[e("M.a", 1), e("M.b", 2)], &reserved);
    assert_eq!(broken.len(), 1, "{broken:?}");
    // c removed, its number and name reserved; e added
    let r = reserved.get_mut("M").unwrap();
    r.numbers.push((3, 4));
    r.names.insert("c".into());
    let (broken, new) = judge(&locked, &[e("M.a", 1), e("M.b", 2), e("M.e", 5)], &reserved);
    assert!(broken.is_empty(), "{broken:?}");
    assert_eq!(new, ["M.e = 5"]);
}
