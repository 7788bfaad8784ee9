//! MODE SENSE(6) and MODE SENSE(10) (SPC-4 MODE SENSE(6), MODE SENSE(10)): the mode parameter
//! header, the block descriptor (SBC-3 block descriptors) and the pages the target reports. Nothing
//! is changeable (MODE SELECT is not supported), so the changeable values are all zero and defaults
//! equal current values.

use super::{get_u16, put_u16, put_u32, put_u64, LunInfo, Sense};

/// Caching mode page (SBC-3 Caching mode page).
pub const PAGE_CACHING: u8 = 0x08;
/// Control mode page (SPC-4 Control mode page).
pub const PAGE_CONTROL: u8 = 0x0A;
/// Informational exceptions control mode page (SPC-4 Informational Exceptions Control mode page).
pub const PAGE_IEC: u8 = 0x1C;
/// Page code asking for every page (SPC-4 MODE SENSE(6)).
pub const PAGE_ALL: u8 = 0x3F;

/// Appends page `code` (page_0 format: PS=0, SPF=0) with current values, or an all-zero mask
/// of the same length when `changeable`.
fn page(code: u8, lun: &LunInfo, changeable: bool, out: &mut Vec<u8>) {
    let start = out.len();
    match code {
        PAGE_CACHING => {
            out.extend_from_slice(&[PAGE_CACHING, 0x12]);
            out.extend_from_slice(&[0; 0x12]);
            if !changeable && lun.write_cache {
                out[start + 2] |= 0x04; // WCE: writes may be cached until SYNCHRONIZE CACHE
            }
        }
        PAGE_CONTROL => {
            out.extend_from_slice(&[PAGE_CONTROL, 0x0A]);
            out.extend_from_slice(&[0; 0x0A]);
            if !changeable {
                // D_SENSE=0: sense data in fixed format. QUEUE ALGORITHM MODIFIER 1: commands
                // may be reordered (SAM-5 task attributes); QERR 00b.
                out[start + 3] = 0x10;
                // BUSY TIMEOUT PERIOD FFFFh: unlimited.
                put_u16(&mut out[start + 8..], 0xFFFF);
            }
        }
        PAGE_IEC => {
            out.extend_from_slice(&[PAGE_IEC, 0x0A]);
            out.extend_from_slice(&[0; 0x0A]);
        }
        _ => {}
    }
}

/// The answer to a MODE SENSE CDB (`ten`: MODE SENSE(10)), truncated to its allocation length.
pub(super) fn mode_sense(cdb: &[u8], lun: &LunInfo, ten: bool) -> Result<Vec<u8>, Sense> {
    let dbd = cdb[1] & 0x08 != 0;
    let llbaa = ten && cdb[1] & 0x10 != 0;
    let pc = cdb[2] >> 6;
    let code = cdb[2] & 0x3F;
    let subpage = cdb[3];
    let alloc = if ten {
        get_u16(&cdb[7..]) as usize
    } else {
        cdb[4] as usize
    };
    if pc == 3 {
        // Saved values: nothing is saved (SPC-4 MODE SENSE(6), PAGE CONTROL).
        return Err(Sense::saving_not_supported().at_cdb(2, 7));
    }
    let codes: &[u8] = match code {
        PAGE_ALL => &[PAGE_CACHING, PAGE_CONTROL, PAGE_IEC],
        PAGE_CACHING => &[PAGE_CACHING],
        PAGE_CONTROL => &[PAGE_CONTROL],
        PAGE_IEC => &[PAGE_IEC],
        _ => return Err(Sense::invalid_cdb_field(2, 5)),
    };
    // No page has subpages: subpage 00h, or FFh ("all subpages") which then means page_0.
    if subpage != 0 && subpage != 0xFF {
        return Err(Sense::invalid_cdb_field(3, 7));
    }
    let hdr = if ten { 8 } else { 4 };
    let mut out = vec![0u8; hdr];
    let mut dsp = 0u8;
    if lun.read_only {
        dsp |= 0x80; // WP
    }
    if lun.fua {
        dsp |= 0x10; // DPOFUA
    }
    out[if ten { 3 } else { 2 }] = dsp;
    if !dbd {
        if llbaa {
            // Long LBA block descriptor (SBC-3 long LBA block descriptor).
            let mut d = [0u8; 16];
            put_u64(&mut d[0..], lun.blocks);
            put_u32(&mut d[12..], lun.block_size);
            out.extend_from_slice(&d);
            out[4] = 0x01; // LONGLBA
        } else {
            // Short LBA block descriptor (SBC-3 short LBA block descriptor): FFFFFFFFh when the
            // count overflows.
            let mut d = [0u8; 8];
            put_u32(&mut d[0..], u32::try_from(lun.blocks).unwrap_or(u32::MAX));
            put_u32(&mut d[4..], lun.block_size & 0x00FF_FFFF);
            out.extend_from_slice(&d);
        }
        let bdl = out.len() - hdr;
        if ten {
            put_u16(&mut out[6..], bdl as u16);
        } else {
            out[3] = bdl as u8;
        }
    }
    for &c in codes {
        page(c, lun, pc == 1, &mut out);
    }
    if ten {
        let len = (out.len() - 2) as u16;
        put_u16(&mut out[0..], len);
    } else {
        out[0] = (out.len() - 1).min(255) as u8;
    }
    out.truncate(alloc);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lun() -> LunInfo {
        LunInfo {
            blocks: 1000,
            write_cache: true,
            fua: true,
            ..LunInfo::default()
        }
    }

    #[test]
    fn sense6_caching_with_descriptor() {
        let b = mode_sense(&[0x1A, 0, PAGE_CACHING, 0, 255, 0], &lun(), false).unwrap();
        assert_eq!(&b[..4], &[3 + 8 + 20, 0, 0x10, 8]);
        assert_eq!(&b[4..12], &[0, 0, 0x03, 0xE8, 0, 0, 0x02, 0x00]);
        assert_eq!(&b[12..15], &[0x08, 0x12, 0x04]);
        assert_eq!(b.len(), 32);
    }

    #[test]
    fn sense10_all_pages_long_lba_read_only() {
        let l = LunInfo {
            read_only: true,
            ..lun()
        };
        let b = mode_sense(&[0x5A, 0x10, PAGE_ALL, 0, 0, 0, 0, 0x10, 0, 0], &l, true).unwrap();
        let total = 8 + 16 + 20 + 12 + 12;
        assert_eq!(b.len(), total);
        assert_eq!(&b[..8], &[0, (total - 2) as u8, 0, 0x90, 1, 0, 0, 16]);
        assert_eq!(&b[8..16], &1000u64.to_be_bytes());
        assert_eq!(
            (b[24], b[44], b[56]),
            (PAGE_CACHING, PAGE_CONTROL, PAGE_IEC)
        );
    }

    #[test]
    fn truncated_changeable_and_errors() {
        let b = mode_sense(&[0x1A, 0x08, PAGE_ALL, 0, 4, 0], &lun(), false).unwrap();
        assert_eq!(b, [3 + 20 + 12 + 12, 0, 0x10, 0]);
        let b = mode_sense(&[0x1A, 0x08, 0x40 | PAGE_CACHING, 0, 255, 0], &lun(), false).unwrap();
        assert!(b[4..].iter().skip(2).all(|&x| x == 0));
        let e = mode_sense(&[0x1A, 0, 0xC0 | PAGE_ALL, 0, 255, 0], &lun(), false).unwrap_err();
        assert_eq!((e.asc, e.ascq), (0x39, 0));
        let e = mode_sense(&[0x1A, 0, 0x19, 0, 255, 0], &lun(), false).unwrap_err();
        assert_eq!(e, Sense::invalid_cdb_field(2, 5));
    }
}
