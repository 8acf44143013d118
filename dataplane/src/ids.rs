//! The numbers the ublk protocol names things by, each its own type so that a queue id can never
//! be passed where a tag or a device id is meant. The inner number is public: it is what the
//! kernel's structures carry.

use std::fmt;

/// A ublk device id: `/dev/ublkbN` and `/dev/ublkcN`. Stored (serde feature) as the bare number.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(transparent)
)]
pub struct DevId(pub u32);

/// A hardware queue of one device, `0..queues`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QueueId(pub u16);

/// A request slot of one queue, `0..queue_depth`: the kernel hands each request in flight a tag,
/// and does not reuse it until the request's result is committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(pub u16);

impl Tag {
    /// The tag as an index into per-tag tables.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

impl QueueId {
    /// The queue as an index into per-queue tables.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

impl fmt::Display for DevId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for QueueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl From<u32> for DevId {
    fn from(v: u32) -> Self {
        DevId(v)
    }
}
