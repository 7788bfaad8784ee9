//! EXTENDED COPY (LID1) and RECEIVE COPY RESULTS (SPC-4 r37 6.4, RECEIVE COPY RESULTS): the
//! parameter list parsed into a [`Plan`] of block-to-block copies between logical units named by
//! NAA designators, and the answers about the copy manager. The transport resolves each [`Target`]
//! to one of its LUNs (by the NAA of VPD 83h), checks the plan with [`Plan::check`] and runs the
//! segments in order.
//!
//! Supported: identification descriptor target descriptors (E4h, SPC-4 r37 identification CSCD
//! descriptor) whose designator is an 8-byte NAA, and block device to block device segment
//! descriptors (02h, SPC-4 r37 block device to block device segment descriptor). Anything else is
//! refused with the additional sense code SPC-4 names for it.

use std::collections::VecDeque;

use super::sense::key;
use super::{get_u16, get_u32, get_u64, put_u16, put_u32, LunInfo, Sense};

/// Bytes of the LID1 parameter list header (SPC-4 r37 6.4.3).
pub const HEADER_LEN: usize = 16;
/// Bytes of an identification descriptor target descriptor (SPC-4 r37 identification CSCD
/// descriptor).
pub const TARGET_LEN: usize = 32;
/// Bytes of a block-to-block segment descriptor (SPC-4 r37 block device to block device segment
/// descriptor), header included.
pub const SEGMENT_B2B_LEN: usize = 28;
/// Target descriptor type code: identification descriptor (SPC-4 table 115).
pub const TARGET_IDENTIFICATION: u8 = 0xE4;
/// Segment descriptor type code: block device to block device (SPC-4 table 125).
pub const SEGMENT_BLOCK_TO_BLOCK: u8 = 0x02;

/// What the copy manager accepts (reported by RECEIVE COPY RESULTS, OPERATING PARAMETERS).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// MAXIMUM TARGET DESCRIPTOR COUNT.
    pub max_target_descriptors: u16,
    /// MAXIMUM SEGMENT DESCRIPTOR COUNT.
    pub max_segment_descriptors: u16,
    /// MAXIMUM DESCRIPTOR LIST LENGTH in bytes (target and segment descriptors together).
    pub max_descriptor_list_length: u32,
    /// MAXIMUM SEGMENT LENGTH in bytes (one segment's blocks times the block size).
    pub max_segment_length: u32,
}

impl Default for Limits {
    fn default() -> Limits {
        // A list as long as this takes more than the most descriptors of each kind allows, so
        // "too many descriptors" is reported as such and not as a length error.
        Limits {
            max_target_descriptors: 2,
            max_segment_descriptors: 8,
            max_descriptor_list_length: 1024,
            max_segment_length: 64 << 20,
        }
    }
}

impl Limits {
    /// The longest LID1 parameter list the copy manager can take: its header and MAXIMUM
    /// DESCRIPTOR LIST LENGTH of descriptors (MAXIMUM INLINE DATA LENGTH is 0). A transport
    /// refuses a longer PARAMETER LIST LENGTH before asking for its data, with PARAMETER LIST
    /// LENGTH ERROR, the answer [`parse`] gives descriptor lists past that maximum (SPC-4 r37
    /// 6.4.3.4).
    pub fn max_list_length(&self) -> u32 {
        HEADER_LEN as u32 + self.max_descriptor_list_length
    }
}

/// A parsed LID1 parameter list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// LIST IDENTIFIER.
    pub list_id: u8,
    /// LIST ID USAGE (SPC-4 table 109): 00b the results are held for RECEIVE COPY RESULTS,
    /// 10b not held, 11b no list identifier.
    pub list_id_usage: u8,
    /// Copy targets, in descriptor order (segments refer to them by index).
    pub targets: Vec<Target>,
    /// Segments, run in order.
    pub segments: Vec<Segment>,
}

/// A copy target: a logical unit named by its NAA designator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    /// The 8-byte NAA designator (as [`LunInfo::naa`]).
    pub naa: u64,
    /// DISK BLOCK LENGTH the initiator expects of it (SPC-4 r37 block device type specific CSCD
    /// parameters).
    pub block_size: u32,
}

/// One block-to-block segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Index of the source in [`Plan::targets`].
    pub src: u16,
    /// Index of the destination in [`Plan::targets`].
    pub dst: u16,
    /// First source block.
    pub src_lba: u64,
    /// First destination block.
    pub dst_lba: u64,
    /// Blocks to copy (0: nothing), of the source, or of the destination when `dc` is set.
    pub blocks: u32,
    /// DC (destination count, byte 1 bit 1 of the segment descriptor, SPC-4 r37 block device to
    /// block device segment descriptor): `blocks` counts destination blocks; clear, source
    /// blocks.
    pub dc: bool,
}

fn param_sense(asc: u8, ascq: u8, at: usize) -> Sense {
    Sense::new(key::ILLEGAL_REQUEST, asc, ascq)
        .at_param(at.min(usize::from(u16::MAX)) as u16, Some(7))
}

/// COPY ABORTED, COPY TARGET DEVICE NOT REACHABLE (0Dh/02h): no LU has the designator.
pub const fn target_not_reachable() -> Sense {
    Sense::new(key::COPY_ABORTED, 0x0D, 0x02)
}
/// COPY ABORTED, UNREACHABLE COPY TARGET (08h/04h): a segment names a target index beyond the
/// target descriptor list.
pub const fn unreachable_copy_target() -> Sense {
    Sense::new(key::COPY_ABORTED, 0x08, 0x04)
}
/// COPY ABORTED with no additional sense: a segment reaches beyond its logical unit.
pub const fn copy_aborted() -> Sense {
    Sense::new(key::COPY_ABORTED, 0x00, 0x00)
}

/// Parses a LID1 parameter list (the Data-Out of EXTENDED COPY, SPC-4 r37 6.4.3). An empty list
/// is no copy at all (PARAMETER LIST LENGTH 0 "shall not be considered an error").
pub fn parse(list: &[u8], limits: &Limits) -> Result<Plan, Sense> {
    if list.is_empty() {
        return Ok(Plan::default());
    }
    if list.len() < HEADER_LEN {
        return Err(Sense::parameter_list_length_error());
    }
    let list_id = list[0];
    let list_id_usage = (list[1] >> 3) & 3;
    if list_id_usage == 1 || (list_id_usage == 3 && list_id != 0) {
        return Err(param_sense(0x26, 0x00, 1));
    }
    let tdl = get_u16(&list[2..]) as usize;
    let sdl = get_u32(&list[8..]) as u64;
    let inline = get_u32(&list[12..]) as u64;
    // SPC-4 r37 6.4.3.4: descriptor lists longer than MAXIMUM DESCRIPTOR LIST LENGTH, or longer
    // than the parameter list that carries them, are PARAMETER LIST LENGTH ERRORs.
    if tdl as u64 + sdl > u64::from(limits.max_descriptor_list_length)
        || (HEADER_LEN + tdl) as u64 + sdl + inline > list.len() as u64
    {
        return Err(Sense::parameter_list_length_error());
    }
    let sdl = sdl as usize;
    if tdl / TARGET_LEN > usize::from(limits.max_target_descriptors) {
        return Err(param_sense(0x26, 0x06, 2)); // TOO MANY TARGET DESCRIPTORS
    }
    if !tdl.is_multiple_of(TARGET_LEN) {
        return Err(param_sense(0x26, 0x00, 2));
    }
    let mut plan = Plan {
        list_id,
        list_id_usage,
        ..Plan::default()
    };
    for (i, d) in list[HEADER_LEN..HEADER_LEN + tdl]
        .chunks_exact(TARGET_LEN)
        .enumerate()
    {
        let at = HEADER_LEN + i * TARGET_LEN;
        if d[0] != TARGET_IDENTIFICATION {
            return Err(param_sense(0x26, 0x07, at)); // UNSUPPORTED TARGET DESCRIPTOR TYPE CODE
        }
        // Byte 1: LU ID TYPE (ignored in SPC-4), NUL (obsolete), PERIPHERAL DEVICE TYPE 00h.
        if d[1] & 0x1F != 0 {
            return Err(param_sense(0x26, 0x00, at + 1));
        }
        // Bytes 4..28: a designation descriptor (SPC-4 designation descriptor). Only a binary
        // 8-byte NAA names an LU here; anything else names none of ours.
        let (code_set, kind, len) = (d[4] & 0x0F, d[5] & 0x0F, d[7]);
        if code_set != 1 || kind != 3 || len != 8 {
            return Err(target_not_reachable());
        }
        let naa = get_u64(&d[8..]);
        let block_size = get_u32(&d[28..]) & 0x00FF_FFFF;
        plan.targets.push(Target { naa, block_size });
    }
    let segs = &list[HEADER_LEN + tdl..HEADER_LEN + tdl + sdl];
    let mut off = 0;
    while off < segs.len() {
        let at = HEADER_LEN + tdl + off;
        if plan.segments.len() == usize::from(limits.max_segment_descriptors) {
            return Err(param_sense(0x26, 0x08, at)); // TOO MANY SEGMENT DESCRIPTORS
        }
        if segs.len() - off < 4 {
            return Err(Sense::parameter_list_length_error());
        }
        let d = &segs[off..];
        if d[0] != SEGMENT_BLOCK_TO_BLOCK {
            return Err(param_sense(0x26, 0x09, at)); // UNSUPPORTED SEGMENT DESCRIPTOR TYPE CODE
        }
        if get_u16(&d[2..]) as usize != SEGMENT_B2B_LEN - 4 {
            return Err(param_sense(0x26, 0x00, at + 2));
        }
        if d.len() < SEGMENT_B2B_LEN {
            return Err(Sense::parameter_list_length_error());
        }
        let seg = Segment {
            src: get_u16(&d[4..]),
            dst: get_u16(&d[6..]),
            blocks: u32::from(get_u16(&d[10..])),
            src_lba: get_u64(&d[12..]),
            dst_lba: get_u64(&d[20..]),
            dc: d[1] & 0x02 != 0,
        };
        let n = plan.targets.len();
        if usize::from(seg.src) >= n || usize::from(seg.dst) >= n {
            return Err(unreachable_copy_target());
        }
        plan.segments.push(seg);
        off += SEGMENT_B2B_LEN;
    }
    Ok(plan)
}

impl Plan {
    /// The bytes segment `s` copies: its NUMBER OF BLOCKS in blocks of the side its DC bit names
    /// (the destination's when set, the source's when clear), as the target descriptors give
    /// their block lengths ([`Plan::check`] holds those to the LUs').
    pub fn bytes(&self, s: &Segment) -> u64 {
        let side = if s.dc { s.dst } else { s.src };
        let block = self
            .targets
            .get(usize::from(side))
            .map_or(0, |t| t.block_size);
        u64::from(s.blocks) * u64::from(block)
    }

    /// Checks every segment against the logical units its targets resolve to (`lookup`: the
    /// transport's LU with that NAA designator): reachable, the block size the initiator gave,
    /// a whole number of blocks of both LUs (the NUMBER OF BLOCKS counts those of the side DC
    /// names; the bytes must be whole blocks of the other too, or the copy would end inside a
    /// block), inside both LUs, within MAXIMUM SEGMENT LENGTH, destination writable.
    pub fn check<'a>(
        &self,
        limits: &Limits,
        lookup: impl Fn(&Target) -> Option<&'a LunInfo>,
    ) -> Result<(), Sense> {
        for (i, s) in self.segments.iter().enumerate() {
            let (Some(st), Some(dt)) = (
                self.targets.get(usize::from(s.src)),
                self.targets.get(usize::from(s.dst)),
            ) else {
                return Err(unreachable_copy_target());
            };
            let src = lookup(st).ok_or_else(target_not_reachable)?;
            let dst = lookup(dt).ok_or_else(target_not_reachable)?;
            for (t, lu, idx) in [(st, src, s.src), (dt, dst, s.dst)] {
                if t.block_size != lu.block_size {
                    let at = HEADER_LEN + usize::from(idx) * TARGET_LEN + 29;
                    return Err(param_sense(0x26, 0x00, at));
                }
            }
            let at = HEADER_LEN + self.targets.len() * TARGET_LEN + i * SEGMENT_B2B_LEN;
            let bytes = self.bytes(s);
            let other = if s.dc { src } else { dst };
            if !bytes.is_multiple_of(u64::from(other.block_size.max(1))) {
                return Err(param_sense(0x26, 0x00, at + 10));
            }
            // In bytes: the two LUs' blocks need not be the same size.
            let in_range = |lu: &LunInfo, lba: u64| {
                let bs = u128::from(lu.block_size);
                u128::from(lba) * bs + u128::from(bytes) <= u128::from(lu.blocks) * bs
            };
            if !in_range(src, s.src_lba) || !in_range(dst, s.dst_lba) {
                return Err(Sense {
                    info: Some(i as u64),
                    ..copy_aborted()
                });
            }
            if bytes > u64::from(limits.max_segment_length) {
                return Err(param_sense(0x26, 0x00, at + 10));
            }
            if dst.read_only {
                return Err(Sense::write_protected());
            }
        }
        Ok(())
    }
}

/// RECEIVE COPY RESULTS, OPERATING PARAMETERS (SA 03h, SPC-4 OPERATING PARAMETERS), truncated to
/// `alloc_len`.
pub fn operating_parameters(limits: &Limits, alloc_len: u32) -> Vec<u8> {
    const CODES: [u8; 2] = [SEGMENT_BLOCK_TO_BLOCK, TARGET_IDENTIFICATION];
    let mut b = vec![0u8; 44];
    put_u32(&mut b[0..], (44 - 4 + CODES.len()) as u32); // AVAILABLE DATA
    b[4] = 0x01; // SNLID: the list identifier is honoured per I_T nexus
    put_u16(&mut b[8..], limits.max_target_descriptors);
    put_u16(&mut b[10..], limits.max_segment_descriptors);
    put_u32(&mut b[12..], limits.max_descriptor_list_length);
    put_u32(&mut b[16..], limits.max_segment_length);
    // MAXIMUM INLINE DATA LENGTH, HELD DATA LIMIT, MAXIMUM STREAM DEVICE TRANSFER SIZE: 0.
    put_u16(&mut b[34..], 1); // TOTAL CONCURRENT COPIES
    b[36] = 1; // MAXIMUM CONCURRENT COPIES
    b[43] = CODES.len() as u8; // IMPLEMENTED DESCRIPTOR LIST LENGTH
    b.extend_from_slice(&CODES);
    b.truncate(alloc_len as usize);
    b
}

/// How a copy ended, as COPY STATUS reports it (SPC-4 COPY STATUS).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyStatus {
    /// LIST IDENTIFIER of the EXTENDED COPY.
    pub list_id: u8,
    /// COPY MANAGER STATUS: 01h completed without errors, 02h completed with errors.
    pub status: u8,
    /// SEGMENTS PROCESSED.
    pub segments: u16,
    /// Bytes copied.
    pub bytes: u64,
}

/// COPY STATUS parameter data (RECEIVE COPY RESULTS SA 00h, SPC-4 COPY STATUS) for a held result;
/// `None` (no copy with that list identifier is held) is INVALID FIELD IN CDB at LIST
/// IDENTIFIER.
pub fn copy_status(done: Option<&CopyStatus>, alloc_len: u32) -> Result<Vec<u8>, Sense> {
    let done = done.ok_or_else(|| Sense::invalid_cdb_field(2, 7))?;
    let mut b = vec![0u8; 12];
    put_u32(&mut b[0..], 8); // AVAILABLE DATA
    b[4] = done.status & 0x7F; // HDD=0: no held data
    put_u16(&mut b[5..], done.segments);
    // TRANSFER COUNT UNITS (table 126): bytes, then powers of 2^10 until the count fits.
    let mut units = 0u8;
    let mut count = done.bytes;
    while count > u64::from(u32::MAX) {
        count >>= 10;
        units += 1;
    }
    b[7] = units;
    put_u32(&mut b[8..], count as u32);
    b.truncate(alloc_len as usize);
    Ok(b)
}

/// The answer to RECEIVE COPY RESULTS (the fields of [`Command::ReceiveCopyResults`]):
/// OPERATING PARAMETERS from `limits`, COPY STATUS from what `history` holds for `list_id`.
///
/// [`Command::ReceiveCopyResults`]: super::Command::ReceiveCopyResults
pub fn receive_copy_results(
    service_action: u8,
    list_id: u8,
    alloc_len: u32,
    limits: &Limits,
    history: &History,
) -> Result<Vec<u8>, Sense> {
    match service_action {
        0x00 => copy_status(history.get(list_id), alloc_len),
        0x03 => Ok(operating_parameters(limits, alloc_len)),
        _ => Err(Sense::invalid_cdb_field(1, 4)),
    }
}

/// The results held for COPY STATUS: the last few copies whose LIST ID USAGE was 00b, newest
/// last. Bounded, so initiators cannot grow it.
#[derive(Clone, Debug, Default)]
pub struct History {
    held: VecDeque<CopyStatus>,
}

impl History {
    /// How many results are held at most.
    pub const CAPACITY: usize = 16;

    /// Records how `plan` ended, if its list identifier asks for that.
    pub fn record(&mut self, plan: &Plan, status: CopyStatus) {
        if plan.list_id_usage != 0 {
            return;
        }
        self.held.retain(|s| s.list_id != status.list_id);
        if self.held.len() == Self::CAPACITY {
            self.held.pop_front();
        }
        self.held.push_back(status);
    }

    /// The held result of list identifier `list_id`.
    pub fn get(&self, list_id: u8) -> Option<&CopyStatus> {
        self.held.iter().find(|s| s.list_id == list_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAA: u64 = 0x5001_4050_0000_0001;

    fn target(kind: u8) -> [u8; 32] {
        let mut d = [0u8; 32];
        d[0] = kind;
        d[4..8].copy_from_slice(&[0x01, 0x03, 0x00, 0x08]);
        d[8..16].copy_from_slice(&NAA.to_be_bytes());
        d[29..32].copy_from_slice(&[0, 0x02, 0x00]);
        d
    }

    fn segment(kind: u8, src: u16, dst: u16, blocks: u16, src_lba: u64, dst_lba: u64) -> [u8; 28] {
        let mut d = [0u8; 28];
        d[0] = kind;
        d[2..4].copy_from_slice(&0x18u16.to_be_bytes());
        d[4..6].copy_from_slice(&src.to_be_bytes());
        d[6..8].copy_from_slice(&dst.to_be_bytes());
        d[10..12].copy_from_slice(&blocks.to_be_bytes());
        d[12..20].copy_from_slice(&src_lba.to_be_bytes());
        d[20..28].copy_from_slice(&dst_lba.to_be_bytes());
        d
    }

    fn list(id: u8, targets: &[[u8; 32]], segs: &[[u8; 28]]) -> Vec<u8> {
        let mut v = vec![0u8; 16];
        v[0] = id;
        v[2..4].copy_from_slice(&((targets.len() * 32) as u16).to_be_bytes());
        v[8..12].copy_from_slice(&((segs.len() * 28) as u32).to_be_bytes());
        for t in targets {
            v.extend_from_slice(t);
        }
        for s in segs {
            v.extend_from_slice(s);
        }
        v
    }

    #[test]
    fn simple_plan() {
        let l = list(7, &[target(0xE4)], &[segment(2, 0, 0, 2048, 0, 100_000)]);
        let plan = parse(&l, &Limits::default()).unwrap();
        assert_eq!(plan.list_id, 7);
        assert_eq!(
            plan.targets,
            [Target {
                naa: NAA,
                block_size: 512
            }]
        );
        assert_eq!(
            plan.segments,
            [Segment {
                src: 0,
                dst: 0,
                src_lba: 0,
                dst_lba: 100_000,
                blocks: 2048,
                dc: false,
            }]
        );
        let lun = LunInfo {
            naa: NAA,
            blocks: 102_048,
            ..LunInfo::default()
        };
        let find = |t: &Target| (t.naa == NAA).then_some(&lun);
        assert_eq!(plan.check(&Limits::default(), find), Ok(()));
        let small = LunInfo {
            blocks: 102_047,
            ..lun.clone()
        };
        let find = |t: &Target| (t.naa == NAA).then_some(&small);
        assert_eq!(
            plan.check(&Limits::default(), find).unwrap_err().key,
            key::COPY_ABORTED
        );
        assert_eq!(
            plan.check(&Limits::default(), |_| None),
            Err(target_not_reachable())
        );
        assert_eq!(parse(&[], &Limits::default()), Ok(Plan::default()));
    }

    /// Two LUs of different block sizes: NUMBER OF BLOCKS counts the source's blocks with DC
    /// clear and the destination's with DC set; the bytes must be whole blocks of both, fit
    /// both LUs and MAXIMUM SEGMENT LENGTH, all in bytes.
    #[test]
    fn segments_between_block_sizes_count_the_blocks_dc_names() {
        const BIG: u64 = 0x5001_4050_0000_0002;
        let mut small_t = target(0xE4);
        let mut big_t = target(0xE4);
        big_t[8..16].copy_from_slice(&BIG.to_be_bytes());
        big_t[29..32].copy_from_slice(&[0, 0x10, 0x00]);
        small_t[29..32].copy_from_slice(&[0, 0x02, 0x00]);
        let small = LunInfo {
            naa: NAA,
            block_size: 512,
            blocks: 64, // 32 KiB
            ..LunInfo::default()
        };
        let big = LunInfo {
            naa: BIG,
            block_size: 4096,
            blocks: 4, // 16 KiB
            ..LunInfo::default()
        };
        let find = |t: &Target| [&small, &big].into_iter().find(|l| l.naa == t.naa);
        let lim = Limits::default();
        // (source, destination, blocks, DC, source LBA, destination LBA)
        let plan = |s: u16, d: u16, blocks: u16, dc: bool, src_lba: u64, dst_lba: u64| {
            let mut seg = segment(2, s, d, blocks, src_lba, dst_lba);
            seg[1] = if dc { 0x02 } else { 0 };
            parse(&list(1, &[small_t, big_t], &[seg]), &lim).unwrap()
        };
        let bytes = |p: &Plan| (p.check(&lim, find), p.bytes(&p.segments[0]));
        // 512 -> 4096: 8 source blocks, or 1 destination block, are 4 KiB.
        assert_eq!(bytes(&plan(0, 1, 8, false, 0, 1)), (Ok(()), 4096));
        assert_eq!(bytes(&plan(0, 1, 1, true, 0, 1)), (Ok(()), 4096));
        assert!(plan(0, 1, 1, true, 0, 1).segments[0].dc);
        // 4096 -> 512: 1 source block, or 8 destination blocks.
        assert_eq!(bytes(&plan(1, 0, 1, false, 3, 56)), (Ok(()), 4096));
        assert_eq!(bytes(&plan(1, 0, 8, true, 3, 56)), (Ok(()), 4096));
        // Not a whole block of the other side: INVALID FIELD IN PARAMETER LIST at NUMBER OF
        // BLOCKS.
        let at_blocks = (HEADER_LEN + 2 * TARGET_LEN + 10) as u16;
        for p in [plan(0, 1, 7, false, 0, 0), plan(1, 0, 7, true, 0, 0)] {
            let e = p.check(&lim, find).unwrap_err();
            assert_eq!((e.key, e.asc, e.ascq), (key::ILLEGAL_REQUEST, 0x26, 0));
            assert_eq!(e.field.map(|f| f.byte), Some(at_blocks));
        }
        // Inside both LUs, in bytes: 2 destination blocks (8 KiB) at destination LBA 3 end
        // past the 16 KiB LU; counted as source blocks (1 KiB) they would not.
        assert_eq!(
            plan(0, 1, 2, true, 0, 3).check(&lim, find).unwrap_err().key,
            key::COPY_ABORTED
        );
        assert_eq!(bytes(&plan(0, 1, 8, false, 56, 3)), (Ok(()), 4096));
        // 2 source blocks of 4 KiB from LBA 2 are the whole of it; from LBA 3, past it.
        assert_eq!(bytes(&plan(1, 0, 2, false, 2, 0)), (Ok(()), 8192));
        assert_eq!(
            plan(1, 0, 2, false, 3, 0)
                .check(&lim, find)
                .unwrap_err()
                .key,
            key::COPY_ABORTED
        );
        // MAXIMUM SEGMENT LENGTH in bytes of the side DC names.
        let tight = Limits {
            max_segment_length: 4096,
            ..lim
        };
        assert_eq!(plan(0, 1, 1, true, 0, 0).check(&tight, find), Ok(()));
        let e = plan(0, 1, 2, true, 0, 0).check(&tight, find).unwrap_err();
        assert_eq!((e.key, e.asc), (key::ILLEGAL_REQUEST, 0x26));
    }

    #[test]
    fn refusals_carry_the_spc4_codes() {
        let lim = Limits::default();
        let asc = |l: &[u8]| {
            parse(l, &lim)
                .map(|_| ())
                .map_err(|e| (e.key, e.asc, e.ascq))
        };
        let ok = list(1, &[target(0xE4)], &[segment(2, 0, 0, 1, 0, 1)]);
        // Truncated inside the target descriptor, inside the segment descriptor.
        assert_eq!(asc(&ok[..16 + 31]), Err((5, 0x1A, 0)));
        assert_eq!(asc(&ok[..ok.len() - 1]), Err((5, 0x1A, 0)));
        assert_eq!(asc(&ok[..15]), Err((5, 0x1A, 0)));
        // Unsupported descriptor types.
        assert_eq!(
            asc(&list(1, &[target(0xE0)], &[segment(2, 0, 0, 1, 0, 1)])),
            Err((5, 0x26, 0x07))
        );
        assert_eq!(
            asc(&list(1, &[target(0xE4)], &[segment(3, 0, 0, 1, 0, 1)])),
            Err((5, 0x26, 0x09))
        );
        // Too many descriptors of each kind.
        let t = target(0xE4);
        assert_eq!(
            asc(&list(1, &[t, t, t], &[segment(2, 0, 0, 1, 0, 1)])),
            Err((5, 0x26, 0x06))
        );
        let s = segment(2, 0, 0, 1, 0, 1);
        assert_eq!(asc(&list(1, &[t], &[s; 9])), Err((5, 0x26, 0x08)));
        assert_eq!(asc(&list(1, &[t], &[s; 8])), Ok(()));
        // Longer than MAXIMUM DESCRIPTOR LIST LENGTH.
        assert_eq!(asc(&list(1, &[t, t, t], &[s; 34])), Err((5, 0x1A, 0)));
        // Index beyond the target list.
        assert_eq!(
            asc(&list(1, &[t], &[segment(2, 0, 1, 1, 0, 1)])),
            Err((0xA, 0x08, 0x04))
        );
        // A designator that is not an 8-byte NAA.
        let mut other = t;
        other[5] = 0x01;
        assert_eq!(asc(&list(1, &[other], &[s])), Err((0xA, 0x0D, 0x02)));
        // LIST ID USAGE 01b is reserved.
        let mut bad = ok.clone();
        bad[1] = 0x08;
        assert_eq!(asc(&bad), Err((5, 0x26, 0)));
    }

    #[test]
    fn operating_parameters_layout() {
        let b = operating_parameters(&Limits::default(), 1024);
        assert_eq!(b.len(), 46);
        assert_eq!(&b[..4], &[0, 0, 0, 42]);
        assert_eq!(&b[8..12], &[0, 2, 0, 8]);
        assert_eq!(&b[12..16], &1024u32.to_be_bytes());
        assert_eq!(&b[43..46], &[2, 0x02, 0xE4]);
        assert_eq!(operating_parameters(&Limits::default(), 8).len(), 8);
    }

    #[test]
    fn copy_status_and_history() {
        let mut h = History::default();
        let plan = Plan {
            list_id: 1,
            ..Plan::default()
        };
        let st = CopyStatus {
            list_id: 1,
            status: 1,
            segments: 1,
            bytes: 1 << 40,
        };
        h.record(&plan, st);
        let b = copy_status(h.get(1), 255).unwrap();
        assert_eq!(b, [0, 0, 0, 8, 1, 0, 1, 1, 0x40, 0, 0, 0]);
        assert_eq!(
            copy_status(h.get(2), 255),
            Err(Sense::invalid_cdb_field(2, 7))
        );
        h.record(
            &Plan {
                list_id: 2,
                list_id_usage: 2,
                ..Plan::default()
            },
            CopyStatus { list_id: 2, ..st },
        );
        assert!(h.get(2).is_none());
        let lim = Limits::default();
        assert_eq!(
            receive_copy_results(0, 1, 255, &lim, &h),
            copy_status(h.get(1), 255)
        );
        assert_eq!(
            receive_copy_results(3, 0, 255, &lim, &h),
            Ok(operating_parameters(&lim, 255))
        );
        assert_eq!(
            receive_copy_results(1, 0, 255, &lim, &h),
            Err(Sense::invalid_cdb_field(1, 4))
        );
        for i in 0..40 {
            h.record(&plan, CopyStatus { list_id: i, ..st });
        }
        assert_eq!(h.held.len(), History::CAPACITY);
    }
}
