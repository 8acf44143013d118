//! Answering a caller over a channel.
//!
//! Every command to the control thread and to a worker carries the sender its answer goes back
//! on. The caller may have stopped waiting by the time the answer is ready: its call timed out,
//! and it already returned an error of its own (a timeout, `Gone`), or the process is shutting
//! down. The answer then has nowhere to go, and nothing is lost by dropping it: the outcome it
//! carries is also in the device table, the volume's state and the statistics. So an answer is
//! sent through [`Answer::answer`], which says so once, instead of a discarded result at every
//! reply.

use std::sync::mpsc::{Sender, SyncSender};

pub(crate) trait Answer<T> {
    /// Sends `value` to a caller that may have gone (see the module's text).
    fn answer(&self, value: T);
}

impl<T> Answer<T> for Sender<T> {
    fn answer(&self, value: T) {
        // The caller stopped waiting: see the module's text for why that loses nothing.
        let _ = self.send(value);
    }
}

impl<T> Answer<T> for SyncSender<T> {
    fn answer(&self, value: T) {
        // The caller stopped waiting: see the module's text for why that loses nothing.
        let _ = self.send(value);
    }
}
