//! What the two datagram fuzz targets (dgram.rs, dgram_reply.rs) share: reading the input step
//! by step, and turning the header fields a step chose into a frame.

use blkwire_wire::{Flags, Header, HEADER_LEN};

/// Takes `n` bytes from the front of `data`.
fn take<'a>(data: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    let (head, rest) = data.split_at_checked(n)?;
    *data = rest;
    Some(head)
}

/// The next step of the input: a control byte, `fields` bytes of header fields, a payload
/// length (2 bytes), the payload (at most `max_payload` bytes and what is left). `None` at the
/// end of the input.
pub fn next_step<'a>(
    rest: &mut &'a [u8],
    fields: usize,
    max_payload: usize,
) -> Option<(u8, &'a [u8], &'a [u8])> {
    let step = take(rest, 1 + fields + 2)?;
    let plen = usize::from(u16::from_le_bytes([step[1 + fields], step[2 + fields]]));
    let payload = take(rest, plen.min(max_payload).min(rest.len()))?;
    Some((step[0], &step[1..1 + fields], payload))
}

/// Appends to `datagram` the frame of header `h` and `payload`: `h` encoded with the payload's
/// length, then `raw` sets the bytes a `Header` cannot hold (any opcode, any status: the
/// receiver must cope with unknown ones), then the CRC (over the header alone if the flags
/// ask for that, PROTOCOL.md §9.7), made wrong when `break_crc`.
pub fn push_frame(
    datagram: &mut Vec<u8>,
    mut h: Header,
    payload: &[u8],
    break_crc: bool,
    raw: impl FnOnce(&mut [u8; HEADER_LEN]),
) {
    h.payload_len = payload.len() as u32;
    let mut b = h.to_bytes();
    raw(&mut b);
    let head_only = u16::from_le_bytes([b[4], b[5]]) & Flags::HEAD_CRC != 0;
    let mut crc = Header::compute_crc(&b, if head_only { &[] } else { payload });
    if break_crc {
        crc ^= 1;
    }
    b[40..44].copy_from_slice(&crc.to_le_bytes());
    datagram.extend_from_slice(&b);
    datagram.extend_from_slice(payload);
}
