//! The COPY descriptor (PROTOCOL.md §13): a COPY request's payload, naming the source export
//! and the source ranges copied, in order, to consecutive bytes from the request's offset.

use blkwire_block::CopyRange;

use crate::handshake::{CopyLimits, PayloadError, PayloadReader, PayloadWriter};

/// A decoded COPY descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyDescriptor {
    /// Another export of the same target, or empty for the session's own.
    pub source: String,
    /// The ranges, in the order they are copied.
    pub ranges: Vec<CopyRange>,
}

impl CopyDescriptor {
    /// Encoded size of one range.
    pub const RANGE_LEN: usize = 16;

    /// Most ranges a descriptor can hold in a payload of `payload` bytes whatever the source
    /// name (up to 255 bytes): a descriptor is never fragmented (§13).
    pub fn ranges_fitting(payload: u32) -> u16 {
        let fixed = 4 + 1 + 255;
        let n = (payload as usize).saturating_sub(fixed) / Self::RANGE_LEN;
        n.min(u16::MAX as usize) as u16
    }

    /// The payload's wire form.
    pub fn encode(&self) -> Result<Vec<u8>, PayloadError> {
        let count = u16::try_from(self.ranges.len())
            .map_err(|_| PayloadError::Invalid("more than 65535 copy ranges"))?;
        let mut w = PayloadWriter::default();
        w.u16(count).u16(0);
        w.str(&self.source)?;
        for r in &self.ranges {
            w.u64(r.offset).u32(r.len).u32(0);
        }
        Ok(w.buf)
    }

    /// Parses a descriptor of at most `max_ranges` ranges; every range non-empty, reserved
    /// fields zero. The total is checked against the request's length by the target.
    pub fn decode(buf: &[u8], max_ranges: u16) -> Result<CopyDescriptor, PayloadError> {
        let mut r = PayloadReader::new(buf);
        let count = r.u16()?;
        if r.u16()? != 0 {
            return Err(PayloadError::Invalid("copy flags must be 0"));
        }
        if count == 0 || count > max_ranges {
            return Err(PayloadError::Invalid("copy range count out of range"));
        }
        let source = r.str()?;
        // Bounded by `max_ranges` (and the payload's length, checked as each range is read).
        let mut ranges = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let (offset, len, reserved) = (r.u64()?, r.u32()?, r.u32()?);
            if len == 0 || reserved != 0 {
                return Err(PayloadError::Invalid(
                    "empty copy range or reserved bits set",
                ));
            }
            ranges.push(CopyRange { offset, len });
        }
        r.finish()?;
        Ok(CopyDescriptor { source, ranges })
    }

    /// Parses a descriptor and checks it against a session's limits (§13): ranges, bytes per
    /// range and bytes in all.
    pub fn decode_within(buf: &[u8], limits: &CopyLimits) -> Result<CopyDescriptor, PayloadError> {
        let d = CopyDescriptor::decode(buf, limits.max_ranges)?;
        if d.ranges.iter().any(|r| r.len > limits.max_range) || d.total() > limits.max_bytes as u64
        {
            return Err(PayloadError::Invalid(
                "copy larger than the session's limits",
            ));
        }
        Ok(d)
    }

    /// Bytes copied in all.
    pub fn total(&self) -> u64 {
        self.ranges.iter().map(|r| r.len as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_and_bad_ones_are_refused() {
        let d = CopyDescriptor {
            source: "golden".into(),
            ranges: vec![
                CopyRange {
                    offset: 0,
                    len: 4096,
                },
                CopyRange {
                    offset: 1 << 40,
                    len: u32::MAX,
                },
            ],
        };
        let b = d.encode().unwrap();
        assert_eq!(b.len(), 4 + 1 + 6 + 2 * CopyDescriptor::RANGE_LEN);
        assert_eq!(CopyDescriptor::decode(&b, 2).unwrap(), d);
        assert_eq!(d.total(), 4096 + u32::MAX as u64);
        assert!(CopyDescriptor::decode(&b, 1).is_err(), "over the limit");
        assert!(CopyDescriptor::decode(&b[..b.len() - 1], 2).is_err(), "cut");
        let d = CopyDescriptor {
            source: String::new(),
            ranges: vec![
                CopyRange {
                    offset: 0,
                    len: 4096,
                },
                CopyRange {
                    offset: 8192,
                    len: 100,
                },
            ],
        };
        let b = d.encode().unwrap();
        let limits = CopyLimits {
            max_bytes: 4196,
            max_range: 4096,
            max_ranges: 2,
        };
        assert_eq!(CopyDescriptor::decode_within(&b, &limits).unwrap(), d);
        for over in [
            CopyLimits {
                max_bytes: limits.max_bytes - 1,
                ..limits
            },
            CopyLimits {
                max_range: limits.max_range - 1,
                ..limits
            },
            CopyLimits {
                max_ranges: 1,
                ..limits
            },
        ] {
            assert!(
                CopyDescriptor::decode_within(&b, &over).is_err(),
                "{over:?}"
            );
        }
        let mut extra = b.clone();
        extra.push(0);
        assert!(CopyDescriptor::decode(&extra, 2).is_err(), "trailing");
        let mut flags = b.clone();
        flags[2] = 1;
        assert!(CopyDescriptor::decode(&flags, 2).is_err(), "flags");
        let empty = CopyDescriptor {
            source: String::new(),
            ranges: vec![CopyRange { offset: 0, len: 0 }],
        };
        assert!(
            CopyDescriptor::decode(&empty.encode().unwrap(), 4).is_err(),
            "empty range"
        );
        let none = CopyDescriptor {
            source: String::new(),
            ranges: vec![],
        };
        assert!(
            CopyDescriptor::decode(&none.encode().unwrap(), 4).is_err(),
            "no range"
        );
    }
}
