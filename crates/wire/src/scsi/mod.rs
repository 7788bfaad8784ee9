//! The SCSI command layer behind the iSCSI frontend: what a CDB asks (SPC-4, SBC-3), checked
//! against the logical unit, and the data-in answers the target builds itself (INQUIRY, READ
//! CAPACITY, MODE SENSE, REPORT LUNS, ...). References name the clause of SPC-4 (T10/BSR INCITS
//! 513) or SBC-3 (T10/BSR INCITS 514) by its command, page or field; a number is given where it
//! was checked against the revision named (SPC-4 r37 for EXTENDED COPY).
//!
//! Pure code like the rest of the crate: no I/O, no threads. [`decode`] turns a CDB into a
//! [`Command`] or into the [`Sense`] of a CHECK CONDITION; it never panics, whatever the bytes
//! (`fuzz/fuzz_targets/scsi.rs`). The answers it builds allocate (they are control-path
//! commands); READ and WRITE decode without allocating.
//!
//! Parameter lists that arrive as Data-Out are parsed by [`parse_unmap`], [`xcopy::parse`] and
//! [`pr::Reservations::reserve_out`]; persistent reservations ([`pr`]) are one state per LUN
//! that the transport shares between its sessions. [`Command::data_out_len`] says how many
//! bytes of Data-Out a command expects, so the transport can refuse a mismatched
//! EXPECTED DATA TRANSFER LENGTH before any I/O.
//!
//! How a transport answers one SCSI command with it:
//! 1. the LUN field names no LU: [`decode_absent`] (LOGICAL UNIT NOT SUPPORTED for all but
//!    INQUIRY, REPORT LUNS and REQUEST SENSE);
//! 2. [`decode`]; `Err(sense)` is CHECK CONDITION with `sense.encode()`;
//! 3. [`pr::Reservations::conflicts`] true: status RESERVATION CONFLICT (18h), nothing done;
//! 4. EXPECTED DATA TRANSFER LENGTH against [`Command::data_out_len`] for writes;
//! 5. run it: [`Command::DataIn`] is sent as it is (its length is at most the allocation
//!    length); READ/WRITE/... go to the backend; parameter lists go through [`parse_unmap`],
//!    [`xcopy::parse`] + [`xcopy::Plan::check`], [`pr::Reservations::reserve_out`];
//!    [`Command::ReportLuns`] is [`report_luns`], [`Command::GetLbaStatus`] [`lba_status`],
//!    [`Command::ReceiveCopyResults`] [`xcopy::receive_copy_results`],
//!    [`Command::PersistentReserveIn`] [`pr::Reservations::reserve_in`].

mod inquiry;
mod mode;
mod opcodes;
pub mod pr;
pub mod sense;
pub mod xcopy;

pub use inquiry::{STANDARD_LEN as INQUIRY_STANDARD_LEN, VPD_PAGES};
pub use sense::{FieldPointer, Sense};

/// What the LUN is, for the answers the target builds itself. Build it with
/// `LunInfo { .., ..LunInfo::default() }` so fields added later keep their defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LunInfo {
    /// The LUN number (SAM-5 flat/peripheral addressing is done by the transport, see
    /// [`lun_to_wire`]).
    pub lun: u64,
    /// Logical block size in bytes (512 or 4096).
    pub block_size: u32,
    /// Number of logical blocks.
    pub blocks: u64,
    /// MODE SENSE WP bit; writes are refused with DATA PROTECT / WRITE PROTECTED.
    pub read_only: bool,
    /// The backend has a volatile cache it flushes: WCE=1 in the caching mode page.
    pub write_cache: bool,
    /// DPOFUA in the MODE SENSE device-specific parameter; without it DPO/FUA in a CDB are refused
    /// as INVALID FIELD IN CDB (SBC-3 mode parameters, what libiscsi's DpoFua tests expect).
    pub fua: bool,
    /// Thin provisioning: LBPME=1 (READ CAPACITY 16), LBPU/LBPWS/LBPWS10 (VPD B2h), unmap limits
    /// in VPD B0h, UNMAP and WRITE SAME with UNMAP accepted.
    pub unmap: bool,
    /// LBPRZ: unmapped blocks read back as zeroes.
    pub zeroes_after_unmap: bool,
    /// 3PC=1 in standard INQUIRY; EXTENDED COPY and RECEIVE COPY RESULTS accepted.
    pub copy: bool,
    /// VPD B1h MEDIUM ROTATION RATE: 0 (not reported) when true, 1 (non-rotating) when false.
    pub rotational: bool,
    /// VPD B0h MAXIMUM TRANSFER LENGTH in blocks; longer transfers are refused (0: no limit).
    pub max_transfer_blocks: u32,
    /// VPD B0h MAXIMUM UNMAP LBA COUNT.
    pub max_unmap_blocks: u32,
    /// VPD B0h MAXIMUM UNMAP BLOCK DESCRIPTOR COUNT.
    pub max_unmap_descriptors: u32,
    /// VPD B0h MAXIMUM WRITE SAME LENGTH (0: no limit beyond the LUN).
    pub max_write_same_blocks: u64,
    /// VPD B0h MAXIMUM COMPARE AND WRITE LENGTH in blocks (0: COMPARE AND WRITE refused).
    pub max_compare_write_blocks: u8,
    /// VPD B0h OPTIMAL UNMAP GRANULARITY in blocks (at least 1).
    pub unmap_granularity: u32,
    /// The NAA designator, all 8 bytes including the NAA nibble (5h, IEEE Registered: build it
    /// with [`naa_registered`]); the first designator of VPD 83h, binary.
    pub naa: u64,
    /// VPD 80h unit serial; also the vendor-specific part of the T10 vendor ID designator.
    pub serial: String,
    /// T10 vendor identification, space-padded to 8 bytes.
    pub vendor: &'static str,
    /// Product identification, space-padded to 16 bytes.
    pub product: &'static str,
    /// Product revision level, space-padded to 4 bytes.
    pub revision: &'static str,
}

impl Default for LunInfo {
    fn default() -> LunInfo {
        LunInfo {
            lun: 0,
            block_size: 512,
            blocks: 0,
            read_only: false,
            write_cache: false,
            fua: false,
            unmap: false,
            zeroes_after_unmap: false,
            copy: false,
            rotational: false,
            max_transfer_blocks: 2048,
            max_unmap_blocks: 1 << 20,
            max_unmap_descriptors: 256,
            max_write_same_blocks: 1 << 16,
            max_compare_write_blocks: 1,
            unmap_granularity: 1,
            naa: naa_registered(0, 0),
            serial: String::new(),
            vendor: "BLKWIRE",
            product: "blkwire",
            revision: "1",
        }
    }
}

/// An NAA IEEE Registered designator (SPC-4 NAA IEEE Registered format): NAA 5h, the 24-bit IEEE
/// company id `oui`, then the low 36 bits of `id`.
pub fn naa_registered(oui: u32, id: u64) -> u64 {
    (5u64 << 60) | (u64::from(oui & 0x00FF_FFFF) << 36) | (id & 0xF_FFFF_FFFF)
}

/// What a CDB asks, checked against the LUN (range, transfer length, read-only, supported).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// TEST UNIT READY: answer GOOD.
    TestUnitReady,
    /// Answer with this data, already truncated to the CDB's allocation length: INQUIRY
    /// (standard and VPD), READ CAPACITY 10/16, MODE SENSE 6/10, REQUEST SENSE, REPORT
    /// SUPPORTED OPERATION CODES.
    DataIn(Vec<u8>),
    /// REPORT LUNS: the transport knows the LUN list, see [`report_luns`].
    ReportLuns {
        /// ALLOCATION LENGTH (at least 16).
        alloc_len: u32,
    },
    /// READ 6/10/12/16: `blocks` 0 means no transfer, answer GOOD.
    Read {
        /// First logical block.
        lba: u64,
        /// Number of blocks (READ(6) length 0 is already turned into 256).
        blocks: u32,
        /// FUA: read from the medium, not a cache.
        fua: bool,
    },
    /// WRITE 6/10/12/16: `blocks` 0 means no transfer, answer GOOD.
    Write {
        /// First logical block.
        lba: u64,
        /// Number of blocks (WRITE(6) length 0 is already turned into 256).
        blocks: u32,
        /// FUA: the data is on stable media before GOOD.
        fua: bool,
    },
    /// VERIFY 10/12/16 (SBC-3): without BYTCHK there is no Data-Out and the medium is
    /// only checked readable; with it Data-Out of `blocks` blocks is compared against the
    /// medium (MISCOMPARE with the offset on a difference).
    Verify {
        /// First logical block.
        lba: u64,
        /// Number of blocks.
        blocks: u32,
        /// Compare Data-Out against the medium.
        bytchk: bool,
    },
    /// WRITE AND VERIFY 10/12/16 (SBC-3): write, then make sure it reads back.
    WriteAndVerify {
        /// First logical block.
        lba: u64,
        /// Number of blocks.
        blocks: u32,
    },
    /// SYNCHRONIZE CACHE 10/16 (SBC-3): `blocks` 0 means through the last
    /// block.
    SynchronizeCache {
        /// First logical block.
        lba: u64,
        /// Number of blocks (0: to the end of the LUN).
        blocks: u32,
    },
    /// WRITE SAME 10/16 (SBC-3). Data-Out is one block unless
    /// `ndob`.
    WriteSame {
        /// First logical block.
        lba: u64,
        /// Number of blocks (never 0: WSNZ=1).
        blocks: u32,
        /// UNMAP: the blocks may be deallocated instead (reads return the block, zeroes).
        unmap: bool,
        /// NDOB: no Data-Out; the block is all zeroes.
        ndob: bool,
    },
    /// UNMAP (SBC-3): Data-Out is the parameter list, see [`parse_unmap`]. `param_len` 0
    /// means nothing to do.
    Unmap {
        /// PARAMETER LIST LENGTH.
        param_len: u32,
    },
    /// COMPARE AND WRITE (SBC-3): Data-Out is 2*blocks blocks, the compare data
    /// then the write data; MISCOMPARE with the offset when the medium differs.
    CompareAndWrite {
        /// First logical block.
        lba: u64,
        /// Number of blocks (1..=max_compare_write_blocks; 0 means nothing to do).
        blocks: u32,
        /// FUA on the write.
        fua: bool,
    },
    /// GET LBA STATUS (SBC-3): answer with [`lba_status`].
    GetLbaStatus {
        /// STARTING LOGICAL BLOCK ADDRESS (inside the LUN).
        lba: u64,
        /// ALLOCATION LENGTH.
        alloc_len: u32,
    },
    /// EXTENDED COPY (LID1, SPC-4 r37 6.4): Data-Out is the parameter list, see `xcopy::parse`.
    ExtendedCopy {
        /// PARAMETER LIST LENGTH.
        param_len: u32,
    },
    /// RECEIVE COPY RESULTS (SPC-4).
    ReceiveCopyResults {
        /// SERVICE ACTION: 00h copy status, 03h operating parameters.
        service_action: u8,
        /// LIST IDENTIFIER (copy status).
        list_id: u8,
        /// ALLOCATION LENGTH.
        alloc_len: u32,
    },
    /// PERSISTENT RESERVE IN (SPC-4).
    PersistentReserveIn {
        /// SERVICE ACTION (00h..03h).
        service_action: u8,
        /// ALLOCATION LENGTH.
        alloc_len: u32,
    },
    /// PERSISTENT RESERVE OUT (SPC-4): Data-Out is the 24-byte parameter
    /// list.
    PersistentReserveOut {
        /// SERVICE ACTION (00h..07h).
        service_action: u8,
        /// SCOPE (0: LU_SCOPE).
        scope: u8,
        /// TYPE of the reservation.
        kind: u8,
        /// PARAMETER LIST LENGTH.
        param_len: u32,
    },
    /// START STOP UNIT (SBC-3): the medium is not removable and always ready; GOOD.
    StartStopUnit {
        /// START.
        start: bool,
        /// LOEJ.
        loej: bool,
    },
    /// PREVENT ALLOW MEDIUM REMOVAL (SBC-3): nothing to remove; GOOD.
    PreventAllowMediumRemoval {
        /// PREVENT field.
        prevent: u8,
    },
    /// PRE-FETCH 10/16 (SBC-3): GOOD (or CONDITION MET) without data.
    PreFetch {
        /// First logical block.
        lba: u64,
        /// Number of blocks.
        blocks: u32,
    },
}

impl Command {
    /// Bytes of Data-Out the command carries for a LUN of `block_size` bytes per block (SBC-3,
    /// SPC-4 per command); 0 for commands without Data-Out. A transport answers a SCSI command
    /// whose EXPECTED DATA TRANSFER LENGTH differs with CHECK CONDITION (libiscsi's
    /// `InvalidDataOutSize` tests), or takes the smaller with a residual (RFC 7143 11.4.5).
    pub fn data_out_len(&self, block_size: u32) -> u64 {
        let bs = u64::from(block_size);
        match *self {
            Command::Write { blocks, .. } | Command::WriteAndVerify { blocks, .. } => {
                u64::from(blocks) * bs
            }
            Command::Verify {
                blocks,
                bytchk: true,
                ..
            } => u64::from(blocks) * bs,
            Command::WriteSame { ndob: false, .. } => bs,
            Command::CompareAndWrite { blocks, .. } => 2 * u64::from(blocks) * bs,
            Command::Unmap { param_len }
            | Command::ExtendedCopy { param_len }
            | Command::PersistentReserveOut { param_len, .. } => u64::from(param_len),
            _ => 0,
        }
    }

    /// Does the command change the medium? (What write protection and the persistent reservation
    /// types that allow reads refuse, the SPC-4/SBC-3 tables of commands allowed under persistent
    /// reservations.)
    pub fn writes(&self) -> bool {
        matches!(
            self,
            Command::Write { .. }
                | Command::WriteAndVerify { .. }
                | Command::WriteSame { .. }
                | Command::Unmap { .. }
                | Command::CompareAndWrite { .. }
                | Command::ExtendedCopy { .. }
                | Command::SynchronizeCache { .. }
        )
    }
}

/// SCSI operation codes this layer knows (SPC-4 and SBC-3 operation code tables).
pub mod op {
    #![allow(missing_docs)]
    pub const TEST_UNIT_READY: u8 = 0x00;
    pub const REQUEST_SENSE: u8 = 0x03;
    pub const READ_6: u8 = 0x08;
    pub const WRITE_6: u8 = 0x0A;
    pub const INQUIRY: u8 = 0x12;
    pub const MODE_SENSE_6: u8 = 0x1A;
    pub const START_STOP_UNIT: u8 = 0x1B;
    pub const PREVENT_ALLOW: u8 = 0x1E;
    pub const READ_CAPACITY_10: u8 = 0x25;
    pub const READ_10: u8 = 0x28;
    pub const WRITE_10: u8 = 0x2A;
    pub const WRITE_AND_VERIFY_10: u8 = 0x2E;
    pub const VERIFY_10: u8 = 0x2F;
    pub const PRE_FETCH_10: u8 = 0x34;
    pub const SYNCHRONIZE_CACHE_10: u8 = 0x35;
    pub const WRITE_SAME_10: u8 = 0x41;
    pub const UNMAP: u8 = 0x42;
    pub const MODE_SENSE_10: u8 = 0x5A;
    pub const PERSISTENT_RESERVE_IN: u8 = 0x5E;
    pub const PERSISTENT_RESERVE_OUT: u8 = 0x5F;
    pub const EXTENDED_COPY: u8 = 0x83;
    pub const RECEIVE_COPY_RESULTS: u8 = 0x84;
    pub const READ_16: u8 = 0x88;
    pub const COMPARE_AND_WRITE: u8 = 0x89;
    pub const WRITE_16: u8 = 0x8A;
    pub const WRITE_AND_VERIFY_16: u8 = 0x8E;
    pub const VERIFY_16: u8 = 0x8F;
    pub const PRE_FETCH_16: u8 = 0x90;
    pub const SYNCHRONIZE_CACHE_16: u8 = 0x91;
    pub const WRITE_SAME_16: u8 = 0x93;
    pub const SERVICE_ACTION_IN_16: u8 = 0x9E;
    pub const REPORT_LUNS: u8 = 0xA0;
    pub const MAINTENANCE_IN: u8 = 0xA3;
    pub const READ_12: u8 = 0xA8;
    pub const WRITE_12: u8 = 0xAA;
    pub const WRITE_AND_VERIFY_12: u8 = 0xAE;
    pub const VERIFY_12: u8 = 0xAF;
    pub const READ_DEFECT_DATA_10: u8 = 0x37;
    pub const READ_DEFECT_DATA_12: u8 = 0xB7;
    /// SERVICE ACTION IN(16) service actions (SBC-3).
    pub const SA_READ_CAPACITY_16: u8 = 0x10;
    pub const SA_GET_LBA_STATUS: u8 = 0x12;
    /// MAINTENANCE IN service action REPORT SUPPORTED OPERATION CODES (SPC-4 6.35).
    pub const SA_REPORT_SUPPORTED_OPCODES: u8 = 0x0C;
}

pub(crate) fn get_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
pub(crate) fn get_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
pub(crate) fn get_u64(b: &[u8]) -> u64 {
    u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}
pub(crate) fn put_u16(b: &mut [u8], v: u16) {
    b[..2].copy_from_slice(&v.to_be_bytes());
}
pub(crate) fn put_u32(b: &mut [u8], v: u32) {
    b[..4].copy_from_slice(&v.to_be_bytes());
}
pub(crate) fn put_u64(b: &mut [u8], v: u64) {
    b[..8].copy_from_slice(&v.to_be_bytes());
}

/// Length of the CDB an operation code takes, from its group (SPC-4 operation code groups); `None`
/// for the reserved and vendor-specific groups 3, 6, 7.
pub fn cdb_len(opcode: u8) -> Option<usize> {
    match opcode >> 5 {
        0 => Some(6),
        1 | 2 => Some(10),
        4 => Some(16),
        5 => Some(12),
        _ => None,
    }
}

/// `lba..lba+blocks` must lie inside the LUN (SBC-3 logical blocks): LOGICAL BLOCK ADDRESS OUT OF
/// RANGE.
fn check_range(lun: &LunInfo, lba: u64, blocks: u64) -> Result<(), Sense> {
    match lba.checked_add(blocks) {
        Some(end) if end <= lun.blocks => Ok(()),
        _ => Err(Sense::lba_out_of_range()),
    }
}

/// Where the fields of a READ/WRITE/VERIFY-like CDB are: (LBA offset, LBA width, length offset,
/// length width). The 6-byte forms are handled apart.
fn layout(len: usize) -> (usize, usize, usize, usize) {
    match len {
        10 => (2, 4, 7, 2),
        12 => (2, 4, 6, 4),
        _ => (2, 8, 10, 4),
    }
}

fn field(cdb: &[u8], at: usize, width: usize) -> u64 {
    match width {
        2 => u64::from(get_u16(&cdb[at..])),
        4 => u64::from(get_u32(&cdb[at..])),
        _ => get_u64(&cdb[at..]),
    }
}

/// The checks every block transfer gets, in the order libiscsi's tests expect them:
/// the transfer length against MAXIMUM TRANSFER LENGTH (INVALID FIELD IN CDB), the range
/// (LBA OUT OF RANGE), then write protection (DATA PROTECT).
fn transfer(lun: &LunInfo, lba: u64, blocks: u64, len_at: u16, write: bool) -> Result<u32, Sense> {
    let limit = if lun.max_transfer_blocks == 0 {
        u64::from(u32::MAX)
    } else {
        u64::from(lun.max_transfer_blocks)
    };
    if blocks > limit {
        return Err(Sense::invalid_cdb_field(len_at, 7));
    }
    check_range(lun, lba, blocks)?;
    if write && lun.read_only {
        return Err(Sense::write_protected());
    }
    Ok(blocks as u32)
}

/// RDPROTECT/WRPROTECT/VRPROTECT (bits 7..5 of byte 1) must be 0: there is no protection
/// information (SBC-3 protection information model, READ(10)); DPO (bit 4) and FUA (bit 3) need
/// DPOFUA.
fn check_protect_dpo_fua(
    cdb: &[u8],
    lun: &LunInfo,
    dpo_bit: bool,
    fua_bit: bool,
) -> Result<bool, Sense> {
    if cdb[1] & 0xE0 != 0 {
        return Err(Sense::invalid_cdb_field(1, 7));
    }
    if !lun.fua {
        if dpo_bit && cdb[1] & 0x10 != 0 {
            return Err(Sense::invalid_cdb_field(1, 4));
        }
        if fua_bit && cdb[1] & 0x08 != 0 {
            return Err(Sense::invalid_cdb_field(1, 3));
        }
    }
    Ok(fua_bit && cdb[1] & 0x08 != 0)
}

/// Decodes `cdb` for `lun`. `Err(sense)`: answer CHECK CONDITION with that sense. The CDB may be
/// longer than its operation code needs (iSCSI pads it to 16 bytes); shorter is refused.
pub fn decode(cdb: &[u8], lun: &LunInfo) -> Result<Command, Sense> {
    let Some(&opcode) = cdb.first() else {
        return Err(Sense::invalid_opcode());
    };
    let Some(len) = cdb_len(opcode) else {
        return Err(Sense::invalid_opcode());
    };
    if cdb.len() < len {
        return Err(Sense::invalid_field_in_cdb());
    }
    let cdb = &cdb[..len];
    let cmd = decode_cdb(cdb, lun);
    // NACA (SAM-5 CONTROL byte): ACA is not supported. Checked once the operation code is known to
    // be supported, so that an unknown one is always INVALID COMMAND OPERATION CODE.
    if cdb[len - 1] & 0x04 != 0 && cmd != Err(Sense::invalid_opcode()) {
        return Err(Sense::invalid_cdb_field(len as u16 - 1, 2));
    }
    cmd
}

/// [`decode`] once the CDB is known to be as long as its group says.
fn decode_cdb(cdb: &[u8], lun: &LunInfo) -> Result<Command, Sense> {
    let opcode = cdb[0];
    let len = cdb.len();
    match opcode {
        op::TEST_UNIT_READY => Ok(Command::TestUnitReady),
        op::REQUEST_SENSE => {
            // Nothing is ever pending (no deferred errors, unit attentions are the transport's):
            // NO SENSE, in the format DESC asks (SPC-4 REQUEST SENSE).
            let mut out = Vec::new();
            if cdb[1] & 0x01 != 0 {
                Sense::no_sense().encode_descriptor(&mut out);
            } else {
                Sense::no_sense().encode(&mut out);
            }
            out.truncate(cdb[4] as usize);
            Ok(Command::DataIn(out))
        }
        op::INQUIRY => inquiry(cdb, lun),
        op::MODE_SENSE_6 => mode::mode_sense(cdb, lun, false).map(Command::DataIn),
        op::MODE_SENSE_10 => mode::mode_sense(cdb, lun, true).map(Command::DataIn),
        op::READ_CAPACITY_10 => {
            // SBC-3 READ CAPACITY(10): with PMI=0 the LBA field must be 0.
            if cdb[8] & 0x01 == 0 && get_u32(&cdb[2..]) != 0 {
                return Err(Sense::invalid_cdb_field(2, 7));
            }
            let mut out = vec![0u8; 8];
            let last = lun.blocks.saturating_sub(1);
            put_u32(&mut out[0..], u32::try_from(last).unwrap_or(u32::MAX));
            put_u32(&mut out[4..], lun.block_size);
            Ok(Command::DataIn(out))
        }
        op::SERVICE_ACTION_IN_16 => match cdb[1] & 0x1F {
            op::SA_READ_CAPACITY_16 => {
                Ok(Command::DataIn(read_capacity_16(lun, get_u32(&cdb[10..]))))
            }
            op::SA_GET_LBA_STATUS => {
                // SBC-3 GET LBA STATUS: the starting LBA must be inside the LUN.
                let lba = get_u64(&cdb[2..]);
                if lba >= lun.blocks {
                    return Err(Sense::lba_out_of_range());
                }
                Ok(Command::GetLbaStatus {
                    lba,
                    alloc_len: get_u32(&cdb[10..]),
                })
            }
            _ => Err(Sense::invalid_cdb_field(1, 4)),
        },
        op::UNMAP => {
            // Write protection first: on a read-only LUN every command that would change the
            // medium is DATA PROTECT, provisioning or not (libiscsi ReadOnly.ReadOnlySBC).
            if lun.read_only {
                return Err(Sense::write_protected());
            }
            if !lun.unmap {
                return Err(Sense::invalid_opcode());
            }
            // ANCHOR (SBC-3 UNMAP): anchored blocks are not supported (ANC_SUP=0).
            if cdb[1] & 0x01 != 0 {
                return Err(Sense::invalid_cdb_field(1, 0));
            }
            Ok(Command::Unmap {
                param_len: u32::from(get_u16(&cdb[7..])),
            })
        }
        op::READ_6 | op::WRITE_6 => {
            let write = opcode == op::WRITE_6;
            let lba = u64::from(get_u32(&cdb[0..]) & 0x001F_FFFF);
            // SBC-3 READ(6)/WRITE(6): TRANSFER LENGTH 0 means 256 blocks.
            let blocks = if cdb[4] == 0 { 256 } else { u64::from(cdb[4]) };
            let blocks = transfer(lun, lba, blocks, 4, write)?;
            Ok(if write {
                Command::Write {
                    lba,
                    blocks,
                    fua: false,
                }
            } else {
                Command::Read {
                    lba,
                    blocks,
                    fua: false,
                }
            })
        }
        op::READ_10 | op::READ_12 | op::READ_16 | op::WRITE_10 | op::WRITE_12 | op::WRITE_16 => {
            let write = matches!(opcode, op::WRITE_10 | op::WRITE_12 | op::WRITE_16);
            let fua = check_protect_dpo_fua(cdb, lun, true, true)?;
            let (la, lw, ta, tw) = layout(len);
            let lba = field(cdb, la, lw);
            let blocks = transfer(lun, lba, field(cdb, ta, tw), ta as u16, write)?;
            Ok(if write {
                Command::Write { lba, blocks, fua }
            } else {
                Command::Read { lba, blocks, fua }
            })
        }
        op::SYNCHRONIZE_CACHE_10 | op::SYNCHRONIZE_CACHE_16 => {
            let (la, lw, ta, tw) = layout(len);
            let lba = field(cdb, la, lw);
            let blocks = field(cdb, ta, tw);
            check_range(lun, lba, blocks)?;
            Ok(Command::SynchronizeCache {
                lba,
                blocks: blocks as u32,
            })
        }
        op::VERIFY_10 | op::VERIFY_12 | op::VERIFY_16 => {
            check_protect_dpo_fua(cdb, lun, true, false)?;
            // BYTCHK (SBC-3 VERIFY(10)): 00b no compare, 01b compare Data-Out; 11b (one block
            // against every block) is not supported, 10b is reserved.
            let bytchk = match (cdb[1] >> 1) & 3 {
                0 => false,
                1 => true,
                _ => return Err(Sense::invalid_cdb_field(1, 2)),
            };
            let (la, lw, ta, tw) = layout(len);
            let lba = field(cdb, la, lw);
            let blocks = transfer(lun, lba, field(cdb, ta, tw), ta as u16, false)?;
            Ok(Command::Verify {
                lba,
                blocks,
                bytchk,
            })
        }
        op::WRITE_AND_VERIFY_10 | op::WRITE_AND_VERIFY_12 | op::WRITE_AND_VERIFY_16 => {
            check_protect_dpo_fua(cdb, lun, true, false)?;
            // BYTCHK (SBC-3 WRITE AND VERIFY(10)): 00b and 01b both mean "verify what was written".
            if (cdb[1] >> 1) & 3 > 1 {
                return Err(Sense::invalid_cdb_field(1, 2));
            }
            let (la, lw, ta, tw) = layout(len);
            let lba = field(cdb, la, lw);
            let blocks = transfer(lun, lba, field(cdb, ta, tw), ta as u16, true)?;
            Ok(Command::WriteAndVerify { lba, blocks })
        }
        op::PRE_FETCH_10 | op::PRE_FETCH_16 => {
            let (la, lw, ta, tw) = layout(len);
            let lba = field(cdb, la, lw);
            let blocks = field(cdb, ta, tw);
            check_range(lun, lba, blocks)?;
            Ok(Command::PreFetch {
                lba,
                blocks: blocks as u32,
            })
        }
        op::WRITE_SAME_10 | op::WRITE_SAME_16 => write_same(cdb, lun),
        op::COMPARE_AND_WRITE => {
            if lun.max_compare_write_blocks == 0 {
                return Err(Sense::invalid_opcode());
            }
            let fua = check_protect_dpo_fua(cdb, lun, true, true)?;
            let lba = get_u64(&cdb[2..]);
            let blocks = cdb[13];
            // SBC-3 COMPARE AND WRITE: more than MAXIMUM COMPARE AND WRITE LENGTH is INVALID FIELD
            // IN CDB.
            if blocks > lun.max_compare_write_blocks {
                return Err(Sense::invalid_cdb_field(13, 7));
            }
            check_range(lun, lba, u64::from(blocks))?;
            if lun.read_only {
                return Err(Sense::write_protected());
            }
            Ok(Command::CompareAndWrite {
                lba,
                blocks: u32::from(blocks),
                fua,
            })
        }
        op::EXTENDED_COPY => {
            if !lun.copy {
                return Err(Sense::invalid_opcode());
            }
            // SERVICE ACTION 00h: EXTENDED COPY (LID1); 01h (LID4) is not supported.
            if cdb[1] & 0x1F != 0 {
                return Err(Sense::invalid_cdb_field(1, 4));
            }
            Ok(Command::ExtendedCopy {
                param_len: get_u32(&cdb[10..]),
            })
        }
        op::RECEIVE_COPY_RESULTS => {
            if !lun.copy {
                return Err(Sense::invalid_opcode());
            }
            let service_action = cdb[1] & 0x1F;
            // 00h COPY STATUS and 03h OPERATING PARAMETERS (SPC-4 RECEIVE COPY RESULTS service
            // actions).
            if service_action != 0x00 && service_action != 0x03 {
                return Err(Sense::invalid_cdb_field(1, 4));
            }
            Ok(Command::ReceiveCopyResults {
                service_action,
                list_id: cdb[2],
                alloc_len: get_u32(&cdb[10..]),
            })
        }
        op::PERSISTENT_RESERVE_IN => {
            let service_action = cdb[1] & 0x1F;
            // READ KEYS, READ RESERVATION, REPORT CAPABILITIES, READ FULL STATUS (SPC-4 PERSISTENT
            // RESERVE IN).
            if service_action > 0x03 {
                return Err(Sense::invalid_cdb_field(1, 4));
            }
            Ok(Command::PersistentReserveIn {
                service_action,
                alloc_len: u32::from(get_u16(&cdb[7..])),
            })
        }
        op::PERSISTENT_RESERVE_OUT => {
            let service_action = cdb[1] & 0x1F;
            // 00h..06h (SPC-4 PERSISTENT RESERVE OUT service actions); REGISTER AND MOVE (07h) is
            // not supported.
            if service_action > 0x06 {
                return Err(Sense::invalid_cdb_field(1, 4));
            }
            // SPC-4 PERSISTENT RESERVE OUT parameter list: without SPEC_I_PT the list is exactly 24
            // bytes; refusing any other length here means no Data-Out is solicited for it.
            let param_len = get_u32(&cdb[5..]);
            if param_len != pr::PARAM_LEN as u32 {
                return Err(Sense::parameter_list_length_error());
            }
            Ok(Command::PersistentReserveOut {
                service_action,
                scope: cdb[2] >> 4,
                kind: cdb[2] & 0x0F,
                param_len,
            })
        }
        op::START_STOP_UNIT => Ok(Command::StartStopUnit {
            start: cdb[4] & 0x01 != 0,
            loej: cdb[4] & 0x02 != 0,
        }),
        op::PREVENT_ALLOW => Ok(Command::PreventAllowMediumRemoval {
            prevent: cdb[4] & 0x03,
        }),
        op::READ_DEFECT_DATA_10 | op::READ_DEFECT_DATA_12 => {
            // SBC-3 READ DEFECT DATA(10)/(12): no defect lists; the header echoes what was asked
            // with an empty list.
            let ten = opcode == op::READ_DEFECT_DATA_10;
            let flags = if ten { cdb[2] } else { cdb[1] } & 0x1F;
            let (mut out, alloc) = if ten {
                (vec![0, flags, 0, 0], get_u16(&cdb[7..]) as usize)
            } else {
                (
                    vec![0, flags, 0, 0, 0, 0, 0, 0],
                    get_u32(&cdb[6..]) as usize,
                )
            };
            out.truncate(alloc);
            Ok(Command::DataIn(out))
        }
        op::MAINTENANCE_IN => match cdb[1] & 0x1F {
            op::SA_REPORT_SUPPORTED_OPCODES => opcodes::report(cdb, lun).map(Command::DataIn),
            _ => Err(Sense::invalid_cdb_field(1, 4)),
        },
        op::REPORT_LUNS => {
            // SPC-4 REPORT LUNS: SELECT REPORT 00h..02h; ALLOCATION LENGTH at least 16.
            if cdb[2] > 0x02 {
                return Err(Sense::invalid_cdb_field(2, 7));
            }
            let alloc_len = get_u32(&cdb[6..]);
            if alloc_len < 16 {
                return Err(Sense::invalid_cdb_field(6, 7));
            }
            Ok(Command::ReportLuns { alloc_len })
        }
        _ => Err(Sense::invalid_opcode()),
    }
}

/// WRITE SAME(10)/(16) (SBC-3 WRITE SAME(10), WRITE SAME(16)).
fn write_same(cdb: &[u8], lun: &LunInfo) -> Result<Command, Sense> {
    let sixteen = cdb.len() == 16;
    if cdb[1] & 0xE0 != 0 {
        return Err(Sense::invalid_cdb_field(1, 7)); // WRPROTECT without protection information
    }
    let anchor = cdb[1] & 0x10 != 0;
    let unmap = cdb[1] & 0x08 != 0;
    // PBDATA/LBDATA (bits 2, 1) are obsolete in SBC-3 and not supported.
    if cdb[1] & 0x06 != 0 {
        return Err(Sense::invalid_cdb_field(1, 2));
    }
    // NDOB (SBC-3 WRITE SAME(16)) exists in WRITE SAME(16) only; bit 0 of WRITE SAME(10) is
    // obsolete.
    let ndob = sixteen && cdb[1] & 0x01 != 0;
    if !sixteen && cdb[1] & 0x01 != 0 {
        return Err(Sense::invalid_cdb_field(1, 0));
    }
    // ANCHOR (SBC-3 thin provisioning): needs UNMAP, and anchored blocks are not supported
    // (ANC_SUP=0).
    if anchor {
        return Err(Sense::invalid_cdb_field(1, 4));
    }
    if lun.read_only {
        return Err(Sense::write_protected());
    }
    // UNMAP without logical block provisioning (LBPWS/LBPWS10 = 0) is refused, so that what
    // the VPD B2h page says is what the command does (libiscsi WriteSame10.UnmapVPD).
    if unmap && !lun.unmap {
        return Err(Sense::invalid_cdb_field(1, 3));
    }
    let (lba, blocks, len_at) = if sixteen {
        (get_u64(&cdb[2..]), u64::from(get_u32(&cdb[10..])), 10)
    } else {
        (
            u64::from(get_u32(&cdb[2..])),
            u64::from(get_u16(&cdb[7..])),
            7,
        )
    };
    // WSNZ=1 (VPD B0h): NUMBER OF LOGICAL BLOCKS 0 is refused, and so is more than MAXIMUM
    // WRITE SAME LENGTH (SBC-3 WRITE SAME(10)).
    if blocks == 0 || (lun.max_write_same_blocks != 0 && blocks > lun.max_write_same_blocks) {
        return Err(Sense::invalid_cdb_field(len_at, 7));
    }
    check_range(lun, lba, blocks)?;
    Ok(Command::WriteSame {
        lba,
        blocks: blocks as u32,
        unmap,
        ndob,
    })
}

/// Decodes a CDB addressed to a LUN that has no logical unit (SAM-5 incorrect logical unit
/// selection "incorrect logical unit"): REPORT LUNS as for any LUN (SPC-4 REPORT LUNS); standard
/// INQUIRY with peripheral qualifier 011b and device type 1Fh ("not capable of supporting a device
/// here", SPC-4 standard INQUIRY data), the other fields from `template`; REQUEST SENSE answers
/// LOGICAL UNIT NOT SUPPORTED; everything else is CHECK CONDITION with that sense.
pub fn decode_absent(cdb: &[u8], template: &LunInfo) -> Result<Command, Sense> {
    let Some(&opcode) = cdb.first() else {
        return Err(Sense::invalid_opcode());
    };
    match opcode {
        op::REPORT_LUNS => decode(cdb, template),
        op::INQUIRY if cdb.len() >= 6 && cdb[1] & 0x03 == 0 && cdb[2] == 0 => {
            let mut out = inquiry::standard(template);
            out[0] = 0x7F;
            out.truncate(get_u16(&cdb[3..]) as usize);
            Ok(Command::DataIn(out))
        }
        op::REQUEST_SENSE if cdb.len() >= 6 => {
            let mut out = Vec::new();
            if cdb[1] & 0x01 != 0 {
                Sense::lun_not_supported().encode_descriptor(&mut out);
            } else {
                Sense::lun_not_supported().encode(&mut out);
            }
            out.truncate(cdb[4] as usize);
            Ok(Command::DataIn(out))
        }
        _ => Err(Sense::lun_not_supported()),
    }
}

/// INQUIRY (SPC-4): standard data, or the VPD page EVPD and PAGE CODE name.
fn inquiry(cdb: &[u8], lun: &LunInfo) -> Result<Command, Sense> {
    let evpd = cdb[1] & 0x01 != 0;
    if cdb[1] & 0x02 != 0 {
        // CMDDT (obsolete since SPC-3): refused as a reserved bit.
        return Err(Sense::invalid_cdb_field(1, 1));
    }
    let page = cdb[2];
    let alloc = get_u16(&cdb[3..]) as usize;
    let mut out = if evpd {
        inquiry::vpd(lun, page).ok_or_else(|| Sense::invalid_cdb_field(2, 7))?
    } else {
        // SPC-4 INQUIRY: PAGE CODE must be 0 when EVPD is 0.
        if page != 0 {
            return Err(Sense::invalid_cdb_field(2, 7));
        }
        inquiry::standard(lun)
    };
    out.truncate(alloc);
    Ok(Command::DataIn(out))
}

/// READ CAPACITY(16) parameter data (SBC-3 READ CAPACITY(16) parameter data), 32 bytes, truncated
/// to `alloc_len`.
fn read_capacity_16(lun: &LunInfo, alloc_len: u32) -> Vec<u8> {
    let mut out = vec![0u8; 32];
    put_u64(&mut out[0..], lun.blocks.saturating_sub(1));
    put_u32(&mut out[8..], lun.block_size);
    // Byte 12: no protection (P_TYPE 0, PROT_EN 0); byte 13: one logical block per physical
    // block; byte 14: LBPME, LBPRZ, lowest aligned LBA 0.
    if lun.unmap {
        out[14] |= 0x80;
    }
    if lun.zeroes_after_unmap {
        out[14] |= 0x40;
    }
    out.truncate(alloc_len as usize);
    out
}

/// The 8 bytes of a LUN on the wire (SAM-5 logical unit numbers): peripheral device addressing
/// below 256, flat space addressing below 16384, otherwise the low 8 bytes as they are (an
/// already-encoded hierarchical LUN).
pub fn lun_to_wire(lun: u64) -> [u8; 8] {
    if lun < 256 {
        [0, lun as u8, 0, 0, 0, 0, 0, 0]
    } else if lun < 16384 {
        [0x40 | (lun >> 8) as u8, lun as u8, 0, 0, 0, 0, 0, 0]
    } else {
        lun.to_be_bytes()
    }
}

/// The LUN number of 8 LUN bytes (SAM-5 logical unit numbers): the inverse of [`lun_to_wire`] for
/// peripheral and flat space addressing with the second level unused; other encodings come back as
/// the raw 8 bytes.
pub fn lun_from_wire(b: [u8; 8]) -> u64 {
    if b[2..] == [0; 6] {
        match b[0] >> 6 {
            0 if b[0] == 0 => return u64::from(b[1]),
            1 => return (u64::from(b[0] & 0x3F) << 8) | u64::from(b[1]),
            _ => {}
        }
    }
    u64::from_be_bytes(b)
}

/// REPORT LUNS parameter data (SPC-4 REPORT LUNS parameter data): LUN LIST LENGTH, then each LUN as
/// [`lun_to_wire`] encodes it; truncated to `alloc_len` (the list length stays the full one).
pub fn report_luns(luns: &[u64], alloc_len: u32) -> Vec<u8> {
    let list = luns.len().saturating_mul(8);
    let mut out = Vec::with_capacity((8 + list).min(alloc_len as usize));
    out.extend_from_slice(&u32::try_from(list).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&[0; 4]);
    for &l in luns {
        if out.len() >= alloc_len as usize {
            break;
        }
        out.extend_from_slice(&lun_to_wire(l));
    }
    out.truncate(alloc_len as usize);
    out
}

/// Bytes of the UNMAP parameter list header (SBC-3 UNMAP parameter list).
pub const UNMAP_HEADER_LEN: usize = 8;
/// Bytes of one UNMAP block descriptor (SBC-3 UNMAP parameter list).
pub const UNMAP_DESCRIPTOR_LEN: usize = 16;

/// The longest UNMAP parameter list [`parse_unmap`] can take for `lun`: its header, the most
/// descriptors MAXIMUM UNMAP BLOCK DESCRIPTOR COUNT allows, and a partial one after them (which
/// is ignored). A target need not collect more of a list than this.
pub fn max_unmap_list_len(lun: &LunInfo) -> usize {
    let descriptors = lun.max_unmap_descriptors as usize + 1;
    UNMAP_HEADER_LEN.saturating_add(descriptors.saturating_mul(UNMAP_DESCRIPTOR_LEN) - 1)
}

/// The UNMAP parameter list (SBC-3 UNMAP parameter list) as (lba, blocks) extents, each
/// range-checked against the LUN, descriptors with 0 blocks dropped. `list` is the Data-Out
/// (PARAMETER LIST LENGTH bytes); an empty list means nothing to do. The count of descriptors and
/// the total of blocks are held to MAXIMUM UNMAP BLOCK DESCRIPTOR COUNT and MAXIMUM UNMAP LBA COUNT
/// (SBC-3 UNMAP: INVALID FIELD IN PARAMETER LIST).
pub fn parse_unmap(list: &[u8], lun: &LunInfo) -> Result<Vec<(u64, u32)>, Sense> {
    if list.is_empty() {
        return Ok(Vec::new());
    }
    // SBC-3 UNMAP: a list shorter than its header is a PARAMETER LIST LENGTH ERROR.
    if list.len() < UNMAP_HEADER_LEN {
        return Err(Sense::parameter_list_length_error());
    }
    let bd_len = get_u16(&list[2..]) as usize;
    // The descriptor data must be inside what was sent; a trailing partial descriptor is
    // ignored (SBC-3 UNMAP parameter list: the length "should be a multiple of 16").
    if UNMAP_HEADER_LEN + bd_len > list.len() {
        return Err(Sense::invalid_field_in_parameter_list().at_param(2, Some(7)));
    }
    let count = bd_len / UNMAP_DESCRIPTOR_LEN;
    if count as u64 > u64::from(lun.max_unmap_descriptors) {
        return Err(Sense::invalid_field_in_parameter_list().at_param(2, Some(7)));
    }
    let mut out = Vec::with_capacity(count);
    let mut total = 0u64;
    for (i, d) in list[UNMAP_HEADER_LEN..UNMAP_HEADER_LEN + count * UNMAP_DESCRIPTOR_LEN]
        .chunks_exact(UNMAP_DESCRIPTOR_LEN)
        .enumerate()
    {
        let lba = get_u64(d);
        let blocks = get_u32(&d[8..]);
        check_range(lun, lba, u64::from(blocks))?;
        total += u64::from(blocks);
        if total > u64::from(lun.max_unmap_blocks) {
            let at = (UNMAP_HEADER_LEN + i * UNMAP_DESCRIPTOR_LEN + 8) as u16;
            return Err(Sense::invalid_field_in_parameter_list().at_param(at, Some(7)));
        }
        if blocks != 0 {
            out.push((lba, blocks));
        }
    }
    Ok(out)
}

/// Bytes of one LBA status descriptor (SBC-3 LBA status descriptor).
pub const LBA_STATUS_DESCRIPTOR_LEN: usize = 16;

/// GET LBA STATUS parameter data (SBC-3 LBA status descriptor) for the extents that follow each
/// other from `lba`: (blocks, deallocated). An extent longer than a descriptor holds is split.
/// Truncated to `alloc_len`; PARAMETER DATA LENGTH stays the full one.
pub fn lba_status(lba: u64, extents: &[(u64, bool)], alloc_len: u32) -> Vec<u8> {
    let per = u64::from(u32::MAX);
    let count = extents
        .iter()
        .fold(0u64, |a, &(n, _)| a.saturating_add(n.div_ceil(per)));
    let full = count
        .saturating_mul(LBA_STATUS_DESCRIPTOR_LEN as u64)
        .saturating_add(4);
    let want = u64::from(alloc_len).min(full.saturating_add(4)) as usize;
    let mut out = Vec::with_capacity(want);
    out.extend_from_slice(&u32::try_from(full).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&[0; 4]);
    let mut at = lba;
    'all: for &(mut n, dealloc) in extents {
        while n > 0 {
            if out.len() >= want {
                break 'all;
            }
            let take = n.min(per);
            let mut d = [0u8; LBA_STATUS_DESCRIPTOR_LEN];
            put_u64(&mut d[0..], at);
            put_u32(&mut d[8..], take as u32);
            d[12] = u8::from(dealloc); // PROVISIONING STATUS: 0 mapped, 1 deallocated
            out.extend_from_slice(&d);
            at = at.wrapping_add(take);
            n -= take;
        }
    }
    out.truncate(alloc_len as usize);
    out
}

#[cfg(test)]
mod tests;
