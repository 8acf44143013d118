//! Pages of ListVolumes and ListSnapshots. A token names the first entry of the next page
//! (`next:<id>`), not a position: an entry deleted or added meanwhile never shifts the pages.

use crate::error::CsiError;

/// What tokens start with.
const TOKEN_PREFIX: &str = "next:";

/// The page of `items` (sorted by `id`) that `starting_token` and `max_entries` ask for, and
/// the token of the page after it (empty after the last). `max_entries` 0 (or negative) is no
/// limit; a token this driver did not give out is ABORTED, as the spec says.
pub fn page<'a, T>(
    items: &'a [T],
    id: impl Fn(&T) -> &str,
    starting_token: &str,
    max_entries: i32,
) -> Result<(&'a [T], String), CsiError> {
    let start = if starting_token.is_empty() {
        0
    } else {
        let first = starting_token
            .strip_prefix(TOKEN_PREFIX)
            .ok_or_else(|| CsiError::BadToken(starting_token.to_owned()))?;
        items.partition_point(|v| id(v) < first)
    };
    let max = usize::try_from(max_entries)
        .ok()
        .filter(|&n| n > 0)
        .unwrap_or(usize::MAX);
    let end = start.saturating_add(max).min(items.len());
    let next = match items.get(end) {
        Some(v) => format!("{TOKEN_PREFIX}{}", id(v)),
        None => String::new(),
    };
    Ok((&items[start..end], next))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids<'a>(p: &'a [&'a str]) -> Vec<&'a str> {
        p.to_vec()
    }

    fn id<'a>(s: &'a &str) -> &'a str {
        s
    }

    #[test]
    fn pages_follow_tokens_that_name_the_next_entry() {
        let all = ["a", "b", "c", "d", "e"];
        let (p, next) = page(&all, id, "", 2).unwrap();
        assert_eq!((ids(p), next.as_str()), (vec!["a", "b"], "next:c"));
        let (p, next) = page(&all, id, &next, 2).unwrap();
        assert_eq!((ids(p), next.as_str()), (vec!["c", "d"], "next:e"));
        let (p, next) = page(&all, id, &next, 0).unwrap();
        assert_eq!((ids(p), next.as_str()), (vec!["e"], ""));
        let (p, next) = page(&all, id, "", 0).unwrap();
        assert_eq!((p.len(), next.as_str()), (5, ""), "no limit");
        let (p, _) = page(&all, id, "", -3).unwrap();
        assert_eq!(p.len(), 5, "a negative limit is none");

        // The entry a token names was deleted: the page starts at the next one, nothing is
        // skipped or repeated.
        let fewer = ["a", "b", "d", "e"];
        let (p, next) = page(&fewer, id, "next:c", 1).unwrap();
        assert_eq!((ids(p), next.as_str()), (vec!["d"], "next:e"));
        let (p, next) = page(&fewer, id, "next:z", 1).unwrap();
        assert_eq!((p.len(), next.as_str()), (0, ""), "past the end");

        let e = page(&all, id, "3", 1).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Aborted);
        let none: [&str; 0] = [];
        let (p, next) = page(&none, id, "", 10).unwrap();
        assert!(p.is_empty() && next.is_empty());
    }
}
