//! What each of a worker's ring operations is for: the token its SQE carries as `user_data`, so
//! that its completion goes to the one handler that expects it. Typed here; packed into the
//! ring's 64 bits only by [`Token::encode`] and read back only by [`Token::decode`].

use crate::ids::Tag;

/// One operation's token. `slot` is the worker's index of the queue the operation belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Token {
    /// The read of the worker's eventfd: commands from the control thread.
    Event,
    /// A per-IO uring_cmd for `tag` (FETCH_REQ, COMMIT_AND_FETCH_REQ).
    Io { slot: u16, tag: Tag },
    /// The backend's operation for `tag`.
    Backend { slot: u16, tag: Tag },
    /// A batch queue's PREP_IO_CMDS.
    Prep { slot: u16 },
    /// A batch queue's multishot FETCH_IO_CMDS on provided-buffer group `group`.
    Fetch { slot: u16, group: u16 },
    /// A batch queue's COMMIT_IO_CMDS from commit buffer `buf`.
    Commit { slot: u16, buf: u16 },
    /// The copy fallback reading a write's data for `tag` from the kernel.
    CopyIn { slot: u16, tag: Tag },
    /// The copy fallback writing a read's data for `tag` back to the kernel.
    CopyOut { slot: u16, tag: Tag },
    /// The back-off timer before `tag`'s backend operation is sent again.
    Retry { slot: u16, tag: Tag },
    /// The queue's throttle timer.
    Throttle { slot: u16 },
}

// The kind of token, in the top byte of `user_data`.
const EVENT: u64 = 1;
const IO: u64 = 2;
const BACKEND: u64 = 3;
const PREP: u64 = 4;
const FETCH: u64 = 5;
const COMMIT: u64 = 6;
const COPY_IN: u64 = 7;
const COPY_OUT: u64 = 8;
const RETRY: u64 = 9;
const THROTTLE: u64 = 10;

impl Token {
    /// The 64 bits the SQE carries: kind in bits 56..64, slot in 32..48, tag or index in 0..16.
    pub(super) fn encode(self) -> u64 {
        let (kind, slot, low) = match self {
            Token::Event => (EVENT, 0, 0),
            Token::Io { slot, tag } => (IO, slot, tag.0),
            Token::Backend { slot, tag } => (BACKEND, slot, tag.0),
            Token::Prep { slot } => (PREP, slot, 0),
            Token::Fetch { slot, group } => (FETCH, slot, group),
            Token::Commit { slot, buf } => (COMMIT, slot, buf),
            Token::CopyIn { slot, tag } => (COPY_IN, slot, tag.0),
            Token::CopyOut { slot, tag } => (COPY_OUT, slot, tag.0),
            Token::Retry { slot, tag } => (RETRY, slot, tag.0),
            Token::Throttle { slot } => (THROTTLE, slot, 0),
        };
        (kind << 56) | (u64::from(slot) << 32) | u64::from(low)
    }

    /// The token `encode` made `user_data` from; `None` for bits it never makes.
    pub(super) fn decode(user_data: u64) -> Option<Token> {
        let kind = user_data >> 56;
        let slot = (user_data >> 32) as u16;
        let low = user_data as u16;
        let tag = Tag(low);
        let token = match kind {
            EVENT => Token::Event,
            IO => Token::Io { slot, tag },
            BACKEND => Token::Backend { slot, tag },
            PREP => Token::Prep { slot },
            FETCH => Token::Fetch { slot, group: low },
            COMMIT => Token::Commit { slot, buf: low },
            COPY_IN => Token::CopyIn { slot, tag },
            COPY_OUT => Token::CopyOut { slot, tag },
            RETRY => Token::Retry { slot, tag },
            THROTTLE => Token::Throttle { slot },
            _ => return None,
        };
        (token.encode() == user_data).then_some(token)
    }

    /// The queue the operation belongs to; `None` for the worker's own eventfd.
    pub(super) fn slot(self) -> Option<u16> {
        match self {
            Token::Event => None,
            Token::Io { slot, .. }
            | Token::Backend { slot, .. }
            | Token::Prep { slot }
            | Token::Fetch { slot, .. }
            | Token::Commit { slot, .. }
            | Token::CopyIn { slot, .. }
            | Token::CopyOut { slot, .. }
            | Token::Retry { slot, .. }
            | Token::Throttle { slot } => Some(slot),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Token;
    use crate::ids::Tag;

    #[test]
    fn every_token_round_trips_and_keeps_its_fields_apart() {
        let (slot, tag) = (0xbeef, Tag(0x1234));
        let all = [
            Token::Event,
            Token::Io { slot, tag },
            Token::Backend { slot, tag },
            Token::Prep { slot },
            Token::Fetch { slot, group: 1 },
            Token::Commit { slot, buf: 0xffff },
            Token::CopyIn { slot, tag },
            Token::CopyOut { slot, tag },
            Token::Retry { slot, tag },
            Token::Throttle { slot },
        ];
        for t in all {
            assert_eq!(Token::decode(t.encode()), Some(t), "{t:?}");
        }
        // Each kind is its own bits: no two tokens with the same fields encode alike.
        let mut bits: Vec<u64> = all.iter().map(|t| t.encode()).collect();
        bits.sort_unstable();
        bits.dedup();
        assert_eq!(bits.len(), all.len());
        assert_eq!(Token::Prep { slot: 7 }.slot(), Some(7));
        assert_eq!(Token::Event.slot(), None);
    }

    #[test]
    fn bits_no_token_makes_decode_to_none() {
        assert_eq!(Token::decode(0), None);
        assert_eq!(Token::decode(11 << 56), None);
        assert_eq!(Token::decode(u64::MAX), None);
        // The right kind with bits no token sets (an event with a slot, a prep with a tag).
        assert_eq!(Token::decode((1 << 56) | (3 << 32)), None);
        assert_eq!(Token::decode((4 << 56) | 5), None);
        assert_eq!(Token::decode((2 << 56) | (1 << 48)), None);
    }
}
