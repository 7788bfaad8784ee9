//! Per-queue counters. Each queue's counters are owned by the thread serving it (plain integers,
//! no atomics); they are reported when the queue closes and summed per session.

use serde::Serialize;

#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct QueueStats {
    pub frames_in: u64,
    pub frames_out: u64,
    pub reads: u64,
    pub writes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub flushes: u64,
    pub trims: u64,
    pub write_zeroes: u64,
    /// Replies with a non-OK status.
    pub errors: u64,
    /// Frames that broke the protocol (the queue is closed after one).
    pub protocol_errors: u64,
    /// Late or duplicate requests dropped (datagram transports; always 0 on TCP).
    pub dropped_duplicates: u64,
}

impl QueueStats {
    pub fn add(&mut self, o: &QueueStats) {
        self.frames_in += o.frames_in;
        self.frames_out += o.frames_out;
        self.reads += o.reads;
        self.writes += o.writes;
        self.bytes_read += o.bytes_read;
        self.bytes_written += o.bytes_written;
        self.flushes += o.flushes;
        self.trims += o.trims;
        self.write_zeroes += o.write_zeroes;
        self.errors += o.errors;
        self.protocol_errors += o.protocol_errors;
        self.dropped_duplicates += o.dropped_duplicates;
    }
}
