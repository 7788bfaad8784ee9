//! INQUIRY answers (SPC-4 INQUIRY): standard data and the vital product data pages 00h, 80h, 83h
//! (SPC-4 VPD parameters) and the SBC-3 pages B0h, B1h, B2h (SBC-3 VPD parameters).

use super::{put_u16, put_u32, put_u64, LunInfo};

/// Bytes of standard INQUIRY data: through the eight version descriptors (SPC-4 standard INQUIRY
/// data).
pub const STANDARD_LEN: usize = 96;

/// VPD pages answered, ascending as SUPPORTED VPD PAGES lists them (SPC-4 Supported VPD Pages
/// page).
pub const VPD_PAGES: [u8; 6] = [0x00, 0x80, 0x83, 0xB0, 0xB1, 0xB2];

/// Version descriptors claimed (SPC-4 table 146): SAM-5, SPC-4, SBC-3, iSCSI (no version).
const VERSION_DESCRIPTORS: [u16; 4] = [0x00A0, 0x0460, 0x04C0, 0x0960];

/// Copies `s` into `dst`, space-padded (SPC-4 ASCII data field requirements: ASCII left-aligned,
/// padded with spaces), printable ASCII only.
fn ascii(dst: &mut [u8], s: &str) {
    dst.fill(b' ');
    for (d, c) in dst.iter_mut().zip(s.bytes()) {
        *d = if (0x20..0x7F).contains(&c) { c } else { b' ' };
    }
}

/// Standard INQUIRY data (SPC-4 standard INQUIRY data), [`STANDARD_LEN`] bytes.
pub fn standard(lun: &LunInfo) -> Vec<u8> {
    let mut b = vec![0u8; STANDARD_LEN];
    b[0] = 0x00; // peripheral qualifier 000b: connected; device type 00h: direct access block
    b[2] = 0x06; // VERSION: SPC-4
    b[3] = 0x10 | 0x02; // HISUP (SAM-5 hierarchical LUNs); RESPONSE DATA FORMAT 2
    b[4] = (STANDARD_LEN - 5) as u8;
    b[5] = if lun.copy { 0x08 } else { 0 }; // 3PC: EXTENDED COPY supported
    b[7] = 0x02; // CMDQUE: tagged queuing (SAM-5 task attributes)
    ascii(&mut b[8..16], lun.vendor);
    ascii(&mut b[16..32], lun.product);
    ascii(&mut b[32..36], lun.revision);
    for (i, v) in VERSION_DESCRIPTORS.iter().enumerate() {
        put_u16(&mut b[58 + 2 * i..], *v);
    }
    b
}

/// The VPD page `page` (SPC-4 VPD parameters), `None` when it is not one of [`VPD_PAGES`].
pub fn vpd(lun: &LunInfo, page: u8) -> Option<Vec<u8>> {
    let mut b = vec![0x00, page, 0, 0];
    match page {
        0x00 => b.extend_from_slice(&VPD_PAGES),
        0x80 => {
            // UNIT SERIAL NUMBER (SPC-4 Unit Serial Number page): printable ASCII, at most what a
            // page holds.
            let serial: Vec<u8> = lun
                .serial
                .bytes()
                .take(252)
                .map(|c| if (0x20..0x7F).contains(&c) { c } else { b' ' })
                .collect();
            b.extend_from_slice(&serial);
        }
        0x83 => device_identification(lun, &mut b),
        0xB0 => block_limits(lun, &mut b),
        0xB1 => {
            // BLOCK DEVICE CHARACTERISTICS (SBC-3 Block Device Characteristics page): MEDIUM
            // ROTATION RATE 0001h means a non-rotating medium (solid state), 0000h "not reported".
            let mut p = [0u8; 0x3C];
            put_u16(&mut p[0..], if lun.rotational { 0 } else { 1 });
            b.extend_from_slice(&p);
        }
        0xB2 => {
            // LOGICAL BLOCK PROVISIONING (SBC-3 Logical Block Provisioning page).
            let mut p = [0u8; 4];
            if lun.unmap {
                p[1] = 0x80 | 0x40 | 0x20; // LBPU, LBPWS, LBPWS10
                p[2] = 0x02; // PROVISIONING TYPE: thin provisioned
            }
            if lun.zeroes_after_unmap {
                p[1] |= 0x04; // LBPRZ
            }
            b.extend_from_slice(&p);
        }
        _ => return None,
    }
    let len = (b.len() - 4) as u16;
    put_u16(&mut b[2..], len);
    Some(b)
}

/// DEVICE IDENTIFICATION (SPC-4 Device Identification page): the binary NAA designator first (what
/// Linux and VMware take as the LU's identity), then a T10 vendor ID designator (vendor + serial).
fn device_identification(lun: &LunInfo, b: &mut Vec<u8>) {
    // Code set 1 (binary), association 00b (logical unit), designator type 3 (NAA), length 8.
    b.extend_from_slice(&[0x01, 0x03, 0x00, 0x08]);
    b.extend_from_slice(&lun.naa.to_be_bytes());
    // Code set 2 (ASCII), association 00b, designator type 1 (T10 vendor ID): 8 bytes of
    // vendor, then the vendor-specific part, here the unit serial.
    let mut vendor = [0u8; 8];
    ascii(&mut vendor, lun.vendor);
    let serial: Vec<u8> = lun
        .serial
        .bytes()
        .take(200)
        .map(|c| if (0x20..0x7F).contains(&c) { c } else { b' ' })
        .collect();
    b.extend_from_slice(&[0x02, 0x01, 0x00, (8 + serial.len()) as u8]);
    b.extend_from_slice(&vendor);
    b.extend_from_slice(&serial);
}

/// BLOCK LIMITS (SBC-3 Block Limits page), page length 3Ch.
fn block_limits(lun: &LunInfo, b: &mut Vec<u8>) {
    let mut p = [0u8; 0x3C];
    // Offsets below are from byte 4 of the page.
    p[0] = 0x01; // WSNZ: WRITE SAME with NUMBER OF LOGICAL BLOCKS 0 is refused
    p[1] = lun.max_compare_write_blocks; // MAXIMUM COMPARE AND WRITE LENGTH
    put_u16(&mut p[2..], 1); // OPTIMAL TRANSFER LENGTH GRANULARITY
    put_u32(&mut p[4..], lun.max_transfer_blocks); // MAXIMUM TRANSFER LENGTH
    put_u32(&mut p[8..], lun.max_transfer_blocks); // OPTIMAL TRANSFER LENGTH
    if lun.unmap {
        put_u32(&mut p[16..], lun.max_unmap_blocks); // MAXIMUM UNMAP LBA COUNT
        put_u32(&mut p[20..], lun.max_unmap_descriptors); // MAXIMUM UNMAP BLOCK DESCRIPTOR COUNT
        put_u32(&mut p[24..], lun.unmap_granularity.max(1)); // OPTIMAL UNMAP GRANULARITY
        put_u32(&mut p[28..], 0x8000_0000); // UGAVALID, alignment 0
    }
    put_u64(&mut p[32..], lun.max_write_same_blocks); // MAXIMUM WRITE SAME LENGTH
    b.extend_from_slice(&p);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lun() -> LunInfo {
        LunInfo {
            naa: 0x5001_4050_0000_0001,
            serial: "abc123".into(),
            unmap: true,
            copy: true,
            max_transfer_blocks: 2048,
            max_unmap_blocks: 1 << 20,
            max_unmap_descriptors: 64,
            max_write_same_blocks: 1 << 16,
            ..LunInfo::default()
        }
    }

    #[test]
    fn standard_layout() {
        let b = standard(&lun());
        assert_eq!(b.len(), 96);
        assert_eq!(&b[..8], &[0, 0, 0x06, 0x12, 91, 0x08, 0, 0x02]);
        assert_eq!(&b[8..16], b"BLKWIRE ");
        assert_eq!(
            &b[58..66],
            &[0x00, 0xA0, 0x04, 0x60, 0x04, 0xC0, 0x09, 0x60]
        );
    }

    #[test]
    fn vpd_83_naa_first() {
        let b = vpd(&lun(), 0x83).unwrap();
        assert_eq!(&b[..4], &[0, 0x83, 0, (b.len() - 4) as u8]);
        assert_eq!(&b[4..8], &[0x01, 0x03, 0x00, 0x08]);
        assert_eq!(&b[8..16], &[0x50, 0x01, 0x40, 0x50, 0, 0, 0, 1]);
        assert_eq!(&b[16..20], &[0x02, 0x01, 0x00, 14]);
        assert_eq!(&b[20..34], b"BLKWIRE abc123");
    }

    #[test]
    fn vpd_b0_limits() {
        let b = vpd(&lun(), 0xB0).unwrap();
        assert_eq!(b.len(), 64);
        assert_eq!(&b[..4], &[0, 0xB0, 0, 0x3C]);
        assert_eq!(b[4], 1);
        assert_eq!(&b[8..12], &2048u32.to_be_bytes());
        assert_eq!(&b[20..24], &(1u32 << 20).to_be_bytes());
        assert_eq!(&b[24..28], &64u32.to_be_bytes());
        assert_eq!(&b[36..44], &(1u64 << 16).to_be_bytes());
    }

    #[test]
    fn vpd_b2_and_00() {
        let b = vpd(&lun(), 0xB2).unwrap();
        assert_eq!(b, [0, 0xB2, 0, 4, 0, 0xE0, 0x02, 0]);
        let b = vpd(&LunInfo::default(), 0xB2).unwrap();
        assert_eq!(b, [0, 0xB2, 0, 4, 0, 0, 0, 0]);
        let b = vpd(&lun(), 0).unwrap();
        assert_eq!(b, [0, 0, 0, 6, 0, 0x80, 0x83, 0xB0, 0xB1, 0xB2]);
        assert!(vpd(&lun(), 0x86).is_none());
    }
}
