//! REPORT SUPPORTED OPERATION CODES (SPC-4 6.35): one table of what `decode` accepts for a LUN,
//! with the CDB usage data of each command (which bits the device server looks at).

use super::{get_u16, get_u32, op, put_u16, put_u32, LunInfo, Sense};

/// Every (opcode, service action) `decode` may accept; `usage` filters by LUN.
const COMMANDS: &[(u8, Option<u8>)] = &[
    (op::TEST_UNIT_READY, None),
    (op::REQUEST_SENSE, None),
    (op::READ_6, None),
    (op::WRITE_6, None),
    (op::INQUIRY, None),
    (op::MODE_SENSE_6, None),
    (op::START_STOP_UNIT, None),
    (op::PREVENT_ALLOW, None),
    (op::READ_CAPACITY_10, None),
    (op::READ_10, None),
    (op::WRITE_10, None),
    (op::WRITE_AND_VERIFY_10, None),
    (op::VERIFY_10, None),
    (op::PRE_FETCH_10, None),
    (op::SYNCHRONIZE_CACHE_10, None),
    (op::READ_DEFECT_DATA_10, None),
    (op::WRITE_SAME_10, None),
    (op::UNMAP, None),
    (op::MODE_SENSE_10, None),
    (op::PERSISTENT_RESERVE_IN, Some(0)),
    (op::PERSISTENT_RESERVE_IN, Some(1)),
    (op::PERSISTENT_RESERVE_IN, Some(2)),
    (op::PERSISTENT_RESERVE_IN, Some(3)),
    (op::PERSISTENT_RESERVE_OUT, Some(0)),
    (op::PERSISTENT_RESERVE_OUT, Some(1)),
    (op::PERSISTENT_RESERVE_OUT, Some(2)),
    (op::PERSISTENT_RESERVE_OUT, Some(3)),
    (op::PERSISTENT_RESERVE_OUT, Some(4)),
    (op::PERSISTENT_RESERVE_OUT, Some(5)),
    (op::PERSISTENT_RESERVE_OUT, Some(6)),
    (op::EXTENDED_COPY, Some(0)),
    (op::RECEIVE_COPY_RESULTS, Some(0)),
    (op::RECEIVE_COPY_RESULTS, Some(3)),
    (op::READ_16, None),
    (op::COMPARE_AND_WRITE, None),
    (op::WRITE_16, None),
    (op::WRITE_AND_VERIFY_16, None),
    (op::VERIFY_16, None),
    (op::PRE_FETCH_16, None),
    (op::SYNCHRONIZE_CACHE_16, None),
    (op::WRITE_SAME_16, None),
    (op::SERVICE_ACTION_IN_16, Some(op::SA_READ_CAPACITY_16)),
    (op::SERVICE_ACTION_IN_16, Some(op::SA_GET_LBA_STATUS)),
    (op::REPORT_LUNS, None),
    (op::MAINTENANCE_IN, Some(op::SA_REPORT_SUPPORTED_OPCODES)),
    (op::READ_12, None),
    (op::WRITE_12, None),
    (op::WRITE_AND_VERIFY_12, None),
    (op::VERIFY_12, None),
    (op::READ_DEFECT_DATA_12, None),
];

/// Does the opcode take a service action? (Whether REPORTING OPTIONS 001b or 010b applies.)
fn has_service_actions(opcode: u8) -> bool {
    COMMANDS.iter().any(|&(o, sa)| o == opcode && sa.is_some())
}

/// CDB USAGE DATA (SPC-4 6.35, one_command format) of a command for this LUN, `None` when `decode`
/// refuses it as an unsupported operation code. Byte 0 is the opcode; a bit is set where `decode`
/// evaluates the CDB bit (DPO/FUA only when DPOFUA is reported, so the DpoFua checks agree).
fn usage(opcode: u8, sa: Option<u8>, lun: &LunInfo) -> Option<Vec<u8>> {
    let dpofua = if lun.fua { 0x18 } else { 0 };
    let dpo = if lun.fua { 0x10 } else { 0 };
    let f = 0xFF;
    let u: &[u8] = match (opcode, sa) {
        (op::TEST_UNIT_READY, None) => &[0, 0, 0, 0, 0, 0x04],
        (op::REQUEST_SENSE, None) => &[0, 0x01, 0, 0, f, 0x04],
        (op::READ_6 | op::WRITE_6, None) => &[0, 0x1F, f, f, f, 0x04],
        (op::INQUIRY, None) => &[0, 0x03, f, f, f, 0x04],
        (op::MODE_SENSE_6, None) => &[0, 0x08, f, f, f, 0x04],
        (op::START_STOP_UNIT, None) => &[0, 0, 0, 0, 0x03, 0x04],
        (op::PREVENT_ALLOW, None) => &[0, 0, 0, 0, 0x03, 0x04],
        (op::READ_CAPACITY_10, None) => &[0, 0, f, f, f, f, 0, 0, 0x01, 0x04],
        (op::READ_10 | op::WRITE_10, None) => &[0, 0xE0 | dpofua, f, f, f, f, 0, f, f, 0x04],
        (op::VERIFY_10 | op::WRITE_AND_VERIFY_10, None) => {
            &[0, 0xE6 | dpo, f, f, f, f, 0, f, f, 0x04]
        }
        (op::PRE_FETCH_10 | op::SYNCHRONIZE_CACHE_10, None) => &[0, 0, f, f, f, f, 0, f, f, 0x04],
        (op::READ_DEFECT_DATA_10, None) => &[0, 0, 0x1F, 0, 0, 0, 0, f, f, 0x04],
        (op::WRITE_SAME_10, None) => &[0, 0xFF, f, f, f, f, 0, f, f, 0x04],
        (op::UNMAP, None) if lun.unmap => &[0, 0x01, 0, 0, 0, 0, 0, f, f, 0x04],
        (op::MODE_SENSE_10, None) => &[0, 0x18, f, f, 0, 0, 0, f, f, 0x04],
        (op::PERSISTENT_RESERVE_IN, Some(0..=3)) => &[0, 0x1F, 0, 0, 0, 0, 0, f, f, 0x04],
        (op::PERSISTENT_RESERVE_OUT, Some(0..=6)) => &[0, 0x1F, f, 0, 0, f, f, f, f, 0x04],
        (op::EXTENDED_COPY, Some(0)) if lun.copy => {
            &[0, 0x1F, 0, 0, 0, 0, 0, 0, 0, 0, f, f, f, f, 0, 0x04]
        }
        (op::RECEIVE_COPY_RESULTS, Some(0 | 3)) if lun.copy => {
            &[0, 0x1F, f, 0, 0, 0, 0, 0, 0, 0, f, f, f, f, 0, 0x04]
        }
        (op::READ_16 | op::WRITE_16, None) => &[
            0,
            0xE0 | dpofua,
            f,
            f,
            f,
            f,
            f,
            f,
            f,
            f,
            f,
            f,
            f,
            f,
            0,
            0x04,
        ],
        (op::COMPARE_AND_WRITE, None) if lun.max_compare_write_blocks > 0 => &[
            0,
            0xE0 | dpofua,
            f,
            f,
            f,
            f,
            f,
            f,
            f,
            f,
            0,
            0,
            0,
            f,
            0,
            0x04,
        ],
        (op::VERIFY_16 | op::WRITE_AND_VERIFY_16, None) => {
            &[0, 0xE6 | dpo, f, f, f, f, f, f, f, f, f, f, f, f, 0, 0x04]
        }
        (op::PRE_FETCH_16 | op::SYNCHRONIZE_CACHE_16, None) => {
            &[0, 0, f, f, f, f, f, f, f, f, f, f, f, f, 0, 0x04]
        }
        (op::WRITE_SAME_16, None) => &[0, 0xFF, f, f, f, f, f, f, f, f, f, f, f, f, 0, 0x04],
        (op::SERVICE_ACTION_IN_16, Some(op::SA_READ_CAPACITY_16)) => {
            &[0, 0x1F, 0, 0, 0, 0, 0, 0, 0, 0, f, f, f, f, 0, 0x04]
        }
        (op::SERVICE_ACTION_IN_16, Some(op::SA_GET_LBA_STATUS)) => {
            &[0, 0x1F, f, f, f, f, f, f, f, f, f, f, f, f, 0, 0x04]
        }
        (op::REPORT_LUNS, None) => &[0, 0, f, 0, 0, 0, f, f, f, f, 0, 0x04],
        (op::MAINTENANCE_IN, Some(op::SA_REPORT_SUPPORTED_OPCODES)) => {
            &[0, 0x1F, 0x87, f, f, f, f, f, f, f, 0, 0x04]
        }
        (op::READ_12 | op::WRITE_12, None) => &[0, 0xE0 | dpofua, f, f, f, f, f, f, f, f, 0, 0x04],
        (op::VERIFY_12 | op::WRITE_AND_VERIFY_12, None) => {
            &[0, 0xE6 | dpo, f, f, f, f, f, f, f, f, 0, 0x04]
        }
        (op::READ_DEFECT_DATA_12, None) => &[0, 0x1F, 0, 0, 0, 0, f, f, f, f, 0, 0x04],
        _ => return None,
    };
    let mut u = u.to_vec();
    u[0] = opcode;
    Some(u)
}

/// The command timeouts descriptor (SPC-4 6.35, command timeouts descriptor): length 0Ah, no
/// timeouts reported.
const TIMEOUTS: [u8; 12] = [0, 0x0A, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];

/// The answer to a REPORT SUPPORTED OPERATION CODES CDB (MAINTENANCE IN, SA 0Ch).
pub(super) fn report(cdb: &[u8], lun: &LunInfo) -> Result<Vec<u8>, Sense> {
    let rctd = cdb[2] & 0x80 != 0;
    let options = cdb[2] & 0x07;
    let opcode = cdb[3];
    let sa = get_u16(&cdb[4..]);
    let alloc = get_u32(&cdb[6..]) as usize;
    let mut out = Vec::new();
    match options {
        0 => {
            // All commands (SPC-4 6.35, all_commands format): command descriptors of 8 bytes (+12
            // with CTDP).
            out.extend_from_slice(&[0; 4]);
            for &(o, s) in COMMANDS {
                let Some(u) = usage(o, s, lun) else { continue };
                let mut d = [0u8; 8];
                d[0] = o;
                put_u16(&mut d[2..], u16::from(s.unwrap_or(0)));
                d[5] = if rctd { 0x02 } else { 0 } | u8::from(s.is_some());
                put_u16(&mut d[6..], u.len() as u16);
                out.extend_from_slice(&d);
                if rctd {
                    out.extend_from_slice(&TIMEOUTS);
                }
            }
            let len = (out.len() - 4) as u32;
            put_u32(&mut out[0..], len);
        }
        1..=3 => {
            // One command (SPC-4 6.35, one_command format). 001b: the opcode must not take service
            // actions; 010b: it must; 011b: either, the service action counting when it does.
            let takes_sa = has_service_actions(opcode);
            let s = match options {
                1 if takes_sa => return Err(Sense::invalid_cdb_field(2, 2)),
                2 if !takes_sa => return Err(Sense::invalid_cdb_field(2, 2)),
                _ if takes_sa => Some(sa),
                _ => None,
            };
            let found = match s {
                Some(sa) => u8::try_from(sa)
                    .ok()
                    .and_then(|sa| usage(opcode, Some(sa), lun)),
                None => usage(opcode, None, lun),
            };
            match found {
                Some(u) => {
                    // SUPPORT 011b: supported as the standard defines it.
                    out.extend_from_slice(&[0, if rctd { 0x80 } else { 0 } | 0x03, 0, 0]);
                    put_u16(&mut out[2..], u.len() as u16);
                    out.extend_from_slice(&u);
                    if rctd {
                        out.extend_from_slice(&TIMEOUTS);
                    }
                }
                // SUPPORT 001b: not supported; no usage data.
                None => out.extend_from_slice(&[0, 0x01, 0, 0]),
            }
        }
        _ => return Err(Sense::invalid_cdb_field(2, 2)),
    }
    out.truncate(alloc);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::{decode, Command};
    use super::*;

    fn rsoc(lun: &LunInfo, b2: u8, opcode: u8, sa: u16) -> Result<Vec<u8>, Sense> {
        let mut c = [0u8; 12];
        c[0] = op::MAINTENANCE_IN;
        c[1] = op::SA_REPORT_SUPPORTED_OPCODES;
        c[2] = b2;
        c[3] = opcode;
        c[4..6].copy_from_slice(&sa.to_be_bytes());
        c[6..10].copy_from_slice(&65535u32.to_be_bytes());
        match decode(&c, lun)? {
            Command::DataIn(d) => Ok(d),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_listed_command_decodes_to_something_other_than_invalid_opcode() {
        let lun = LunInfo {
            blocks: 1 << 20,
            unmap: true,
            copy: true,
            ..LunInfo::default()
        };
        let all = rsoc(&lun, 0, 0, 0).unwrap();
        let len = get_u32(&all) as usize;
        assert_eq!(len, all.len() - 4);
        let mut n = 0;
        for d in all[4..].chunks(8) {
            let mut cdb = [0u8; 16];
            cdb[0] = d[0];
            if d[5] & 1 != 0 {
                cdb[1] = d[3];
            }
            let cdb_len = get_u16(&d[6..]) as usize;
            assert_eq!(Some(cdb_len), super::super::cdb_len(d[0]));
            assert_ne!(
                decode(&cdb[..cdb_len], &lun),
                Err(Sense::invalid_opcode()),
                "{:02x}",
                d[0]
            );
            n += 1;
        }
        assert_eq!(n, COMMANDS.len());
        // And nothing outside the table decodes.
        for o in 0..=255u8 {
            if COMMANDS.iter().all(|&(c, _)| c != o) {
                assert_eq!(
                    decode(&[o; 16][..], &lun).err().map(|e| e.asc),
                    Some(0x20),
                    "{o:02x}"
                );
            }
        }
    }

    #[test]
    fn one_command_and_dpofua_usage() {
        let lun = LunInfo {
            fua: false,
            ..LunInfo::default()
        };
        let d = rsoc(&lun, 1, op::READ_10, 0).unwrap();
        assert_eq!(&d[..4], &[0, 0x03, 0, 10]);
        assert_eq!(d[4], op::READ_10);
        assert_eq!(d[5] & 0x18, 0);
        let fua = LunInfo {
            fua: true,
            ..LunInfo::default()
        };
        assert_eq!(rsoc(&fua, 1, op::READ_10, 0).unwrap()[5] & 0x18, 0x18);
        // Service-action commands need 010b, the others 001b.
        assert_eq!(
            rsoc(&lun, 1, op::PERSISTENT_RESERVE_IN, 0),
            Err(Sense::invalid_cdb_field(2, 2))
        );
        assert_eq!(
            rsoc(&lun, 2, op::READ_10, 0),
            Err(Sense::invalid_cdb_field(2, 2))
        );
        let d = rsoc(&lun, 2, op::SERVICE_ACTION_IN_16, 0x10).unwrap();
        assert_eq!(&d[..6], &[0, 0x03, 0, 16, 0x9E, 0x1F]);
        // Unsupported: SUPPORT 001b.
        assert_eq!(rsoc(&lun, 1, 0x02, 0).unwrap(), [0, 0x01, 0, 0]);
        // RCTD: timeouts descriptor of length 0Ah after every command descriptor.
        let d = rsoc(&lun, 0x80, 0, 0).unwrap();
        assert_eq!(d[4 + 5] & 0x02, 0x02);
        assert_eq!(&d[12..14], &[0, 0x0A]);
        let d = rsoc(&lun, 0x81, op::READ_10, 0).unwrap();
        assert_eq!(d[1], 0x83);
        assert_eq!(&d[14..16], &[0, 0x0A]);
    }
}
