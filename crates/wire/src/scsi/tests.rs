//! decode() against the LUN: exact bytes where SPC-4/SBC-3 fix them, and the sense each refusal
//! carries.

use super::*;

fn lun() -> LunInfo {
    LunInfo {
        blocks: 1 << 20,
        max_transfer_blocks: 2048,
        unmap: true,
        zeroes_after_unmap: true,
        fua: true,
        naa: naa_registered(0x001405, 0x1234),
        serial: "0001".into(),
        ..LunInfo::default()
    }
}

fn cdb16(b: &[u8]) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[..b.len()].copy_from_slice(b);
    c
}

fn data(cdb: &[u8], l: &LunInfo) -> Vec<u8> {
    match decode(cdb, l) {
        Ok(Command::DataIn(d)) => d,
        other => panic!("{cdb:02x?}: {other:?}"),
    }
}

#[test]
fn test_unit_ready_and_unknown_opcode() {
    assert_eq!(decode(&[0; 6], &lun()), Ok(Command::TestUnitReady));
    assert_eq!(
        decode(&cdb16(&[0x02]), &lun()),
        Err(Sense::invalid_opcode())
    );
    assert_eq!(
        decode(&cdb16(&[0x7F]), &lun()),
        Err(Sense::invalid_opcode())
    );
    assert_eq!(decode(&[], &lun()), Err(Sense::invalid_opcode()));
    assert_eq!(
        decode(&[0x28, 0, 0], &lun()),
        Err(Sense::invalid_field_in_cdb())
    );
    // NACA in the control byte.
    assert_eq!(
        decode(&[0, 0, 0, 0, 0, 0x04], &lun()),
        Err(Sense::invalid_cdb_field(5, 2))
    );
}

#[test]
fn inquiry_standard_vpd_and_alloc_len() {
    let l = lun();
    let d = data(&cdb16(&[0x12, 0, 0, 0, 255]), &l);
    assert_eq!(d.len(), 96);
    assert_eq!(d[0], 0);
    let d = data(&cdb16(&[0x12, 0, 0, 0, 5]), &l);
    assert_eq!(d, [0, 0, 0x06, 0x12, 91]);
    assert!(data(&cdb16(&[0x12, 0, 0, 0, 0]), &l).is_empty());
    let d = data(&cdb16(&[0x12, 1, 0x83, 0, 255]), &l);
    assert_eq!(&d[4..8], &[0x01, 0x03, 0x00, 0x08]);
    assert_eq!(&d[8..16], &[0x50, 0x01, 0x40, 0x50, 0, 0, 0x12, 0x34]);
    let d = data(&cdb16(&[0x12, 1, 0x80, 0, 255]), &l);
    assert_eq!(d, [0, 0x80, 0, 4, b'0', b'0', b'0', b'1']);
    let d = data(&cdb16(&[0x12, 1, 0xB1, 0, 255]), &l);
    assert_eq!(&d[..6], &[0, 0xB1, 0, 0x3C, 0, 1]);
    // EVPD=0 with a page code, an unknown page, CMDDT.
    assert_eq!(
        decode(&cdb16(&[0x12, 0, 0x80, 0, 255]), &l),
        Err(Sense::invalid_cdb_field(2, 7))
    );
    assert_eq!(
        decode(&cdb16(&[0x12, 1, 0x99, 0, 255]), &l),
        Err(Sense::invalid_cdb_field(2, 7))
    );
    assert_eq!(
        decode(&cdb16(&[0x12, 2, 0, 0, 255]), &l),
        Err(Sense::invalid_cdb_field(1, 1))
    );
}

#[test]
fn read_capacity_10_and_16() {
    let l = lun();
    let d = data(&cdb16(&[0x25]), &l);
    assert_eq!(d, [0x00, 0x0F, 0xFF, 0xFF, 0, 0, 0x02, 0x00]);
    assert_eq!(
        decode(&cdb16(&[0x25, 0, 0, 0, 0, 1]), &l),
        Err(Sense::invalid_cdb_field(2, 7))
    );
    let big = LunInfo {
        blocks: 1 << 33,
        block_size: 4096,
        ..lun()
    };
    assert_eq!(
        data(&cdb16(&[0x25]), &big),
        [0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0x10, 0]
    );
    let d = data(
        &cdb16(&[0x9E, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32]),
        &big,
    );
    let mut want = [0u8; 32];
    want[..8].copy_from_slice(&((1u64 << 33) - 1).to_be_bytes());
    want[8..12].copy_from_slice(&4096u32.to_be_bytes());
    want[14] = 0xC0; // LBPME, LBPRZ
    assert_eq!(d, want);
    let d = data(
        &cdb16(&[0x9E, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12]),
        &big,
    );
    assert_eq!(d.len(), 12);
    let thick = LunInfo {
        unmap: false,
        zeroes_after_unmap: false,
        ..lun()
    };
    assert_eq!(
        data(
            &cdb16(&[0x9E, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32]),
            &thick
        )[14],
        0
    );
    assert_eq!(
        decode(&cdb16(&[0x9E, 0x1F]), &l),
        Err(Sense::invalid_cdb_field(1, 4))
    );
}

#[test]
fn read_write_all_sizes() {
    let l = lun();
    assert_eq!(
        decode(&cdb16(&[0x08, 0x01, 0x02, 0x03, 0]), &l),
        Ok(Command::Read {
            lba: 0x10203,
            blocks: 256,
            fua: false
        })
    );
    assert_eq!(
        decode(&cdb16(&[0x0A, 0xE0, 0, 7, 2]), &l),
        Ok(Command::Write {
            lba: 7,
            blocks: 2,
            fua: false
        })
    );
    assert_eq!(
        decode(&cdb16(&[0x28, 0x08, 0, 0, 1, 0, 0, 0, 8]), &l),
        Ok(Command::Read {
            lba: 256,
            blocks: 8,
            fua: true
        })
    );
    assert_eq!(
        decode(&cdb16(&[0xAA, 0, 0, 0, 0, 9, 0, 0, 0, 1]), &l),
        Ok(Command::Write {
            lba: 9,
            blocks: 1,
            fua: false
        })
    );
    assert_eq!(
        decode(
            &cdb16(&[0x88, 0, 0, 0, 0, 0, 0, 0x0F, 0xFF, 0xF0, 0, 0, 0, 0x10]),
            &l
        ),
        Ok(Command::Read {
            lba: 0xFFFF0,
            blocks: 16,
            fua: false
        })
    );
    assert_eq!(
        decode(&cdb16(&[0x8A, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]), &l),
        Ok(Command::Write {
            lba: 0,
            blocks: 0,
            fua: false
        })
    );
}

#[test]
fn read_write_refusals() {
    let l = lun();
    let end = (1u32 << 20).to_be_bytes();
    // Zero blocks at the end is fine, one past it is not (libiscsi Read10.ZeroBlocks).
    assert!(decode(
        &cdb16(&[0x28, 0, end[0], end[1], end[2], end[3], 0, 0, 0]),
        &l
    )
    .is_ok());
    let past = ((1u32 << 20) + 1).to_be_bytes();
    assert_eq!(
        decode(
            &cdb16(&[0x28, 0, past[0], past[1], past[2], past[3], 0, 0, 0]),
            &l
        ),
        Err(Sense::lba_out_of_range())
    );
    // Straddling the end, and LBA = 2^64-1 (no overflow).
    let last = ((1u32 << 20) - 1).to_be_bytes();
    assert_eq!(
        decode(
            &cdb16(&[0x2A, 0, last[0], last[1], last[2], last[3], 0, 0, 2]),
            &l
        ),
        Err(Sense::lba_out_of_range())
    );
    assert_eq!(
        decode(
            &cdb16(&[0x88, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 1]),
            &l
        ),
        Err(Sense::lba_out_of_range())
    );
    // Longer than MAXIMUM TRANSFER LENGTH.
    assert_eq!(
        decode(&cdb16(&[0x28, 0, 0, 0, 0, 0, 0, 0x08, 0x01]), &l),
        Err(Sense::invalid_cdb_field(7, 7))
    );
    // RDPROTECT/WRPROTECT without protection information.
    assert_eq!(
        decode(&cdb16(&[0x28, 0x20, 0, 0, 0, 0, 0, 0, 1]), &l),
        Err(Sense::invalid_cdb_field(1, 7))
    );
    assert_eq!(
        decode(&cdb16(&[0xAA, 0x40, 0, 0, 0, 0, 0, 0, 0, 1]), &l),
        Err(Sense::invalid_cdb_field(1, 7))
    );
    // DPO/FUA when DPOFUA is not reported.
    let nofua = LunInfo {
        fua: false,
        ..lun()
    };
    assert_eq!(
        decode(&cdb16(&[0x28, 0x10, 0, 0, 0, 0, 0, 0, 1]), &nofua),
        Err(Sense::invalid_cdb_field(1, 4))
    );
    assert_eq!(
        decode(&cdb16(&[0x2A, 0x08, 0, 0, 0, 0, 0, 0, 1]), &nofua),
        Err(Sense::invalid_cdb_field(1, 3))
    );
    // Read-only: writes refused, reads fine.
    let ro = LunInfo {
        read_only: true,
        ..lun()
    };
    assert_eq!(
        decode(&cdb16(&[0x2A, 0, 0, 0, 0, 0, 0, 0, 1]), &ro),
        Err(Sense::write_protected())
    );
    assert_eq!(
        decode(&cdb16(&[0x0A, 0, 0, 0, 1]), &ro),
        Err(Sense::write_protected())
    );
    assert!(decode(&cdb16(&[0x28, 0, 0, 0, 0, 0, 0, 0, 1]), &ro).is_ok());
    // READ(6) length 0 is 256 blocks, beyond a 2048-block limit it is not, but beyond a
    // 100-block LUN it is.
    let small = LunInfo {
        blocks: 100,
        ..lun()
    };
    assert_eq!(
        decode(&cdb16(&[0x08, 0, 0, 0, 0]), &small),
        Err(Sense::lba_out_of_range())
    );
}

#[test]
fn synchronize_cache() {
    let l = lun();
    assert_eq!(
        decode(&cdb16(&[0x35, 0x02, 0, 0, 0, 5, 0, 0, 3]), &l),
        Ok(Command::SynchronizeCache { lba: 5, blocks: 3 })
    );
    assert_eq!(
        decode(&cdb16(&[0x91, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]), &l),
        Ok(Command::SynchronizeCache { lba: 0, blocks: 0 })
    );
    assert_eq!(
        decode(
            &cdb16(&[0x91, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 1]),
            &l
        ),
        Err(Sense::lba_out_of_range())
    );
}

#[test]
fn report_luns_cdb_and_data() {
    let l = lun();
    assert_eq!(
        decode(&cdb16(&[0xA0, 0, 0, 0, 0, 0, 0, 0, 1, 0]), &l),
        Ok(Command::ReportLuns { alloc_len: 256 })
    );
    assert_eq!(
        decode(&cdb16(&[0xA0, 0, 0, 0, 0, 0, 0, 0, 0, 15]), &l),
        Err(Sense::invalid_cdb_field(6, 7))
    );
    assert_eq!(
        decode(&cdb16(&[0xA0, 0, 3, 0, 0, 0, 0, 0, 1, 0]), &l),
        Err(Sense::invalid_cdb_field(2, 7))
    );
    let d = report_luns(&[0, 1, 300], 256);
    assert_eq!(&d[..8], &[0, 0, 0, 24, 0, 0, 0, 0]);
    assert_eq!(&d[8..16], &[0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(&d[16..24], &[0, 1, 0, 0, 0, 0, 0, 0]);
    assert_eq!(&d[24..32], &[0x41, 0x2C, 0, 0, 0, 0, 0, 0]);
    let d = report_luns(&[0, 1, 300], 16);
    assert_eq!(d.len(), 16);
    assert_eq!(&d[..4], &[0, 0, 0, 24]);
    for l in [0, 1, 255, 256, 16383, 1 << 40] {
        assert_eq!(lun_from_wire(lun_to_wire(l)), l);
    }
}

#[test]
fn mode_sense_through_decode() {
    let l = lun();
    let d = data(&cdb16(&[0x1A, 0x08, 0x3F, 0, 255]), &l);
    assert_eq!(d[0] as usize, d.len() - 1);
    assert_eq!(d[2], 0x10);
    let d = data(&cdb16(&[0x5A, 0x08, 0x0A, 0, 0, 0, 0, 0, 255]), &l);
    assert_eq!(&d[..8], &[0, 18, 0, 0x10, 0, 0, 0, 0]);
    assert_eq!(&d[8..10], &[0x0A, 0x0A]);
}

#[test]
fn request_sense_no_sense() {
    let d = data(&cdb16(&[0x03, 0, 0, 0, 18]), &lun());
    assert_eq!(
        d,
        [0x70, 0, 0, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    let d = data(&cdb16(&[0x03, 1, 0, 0, 252]), &lun());
    assert_eq!(d, [0x72, 0, 0, 0, 0, 0, 0, 0]);
}

fn unmap_list(descs: &[(u64, u32)]) -> Vec<u8> {
    let mut v = vec![0u8; 8];
    put_u16(&mut v[0..], (6 + 16 * descs.len()) as u16);
    put_u16(&mut v[2..], (16 * descs.len()) as u16);
    for &(lba, n) in descs {
        let mut d = [0u8; 16];
        put_u64(&mut d[0..], lba);
        put_u32(&mut d[8..], n);
        v.extend_from_slice(&d);
    }
    v
}

#[test]
fn unmap_cdb_and_list() {
    let l = LunInfo {
        max_unmap_blocks: 100,
        max_unmap_descriptors: 2,
        ..lun()
    };
    assert_eq!(
        decode(&cdb16(&[0x42, 0, 0, 0, 0, 0, 0, 0, 24]), &l),
        Ok(Command::Unmap { param_len: 24 })
    );
    assert_eq!(
        decode(&cdb16(&[0x42, 1, 0, 0, 0, 0, 0, 0, 24]), &l),
        Err(Sense::invalid_cdb_field(1, 0))
    );
    let thick = LunInfo {
        unmap: false,
        ..lun()
    };
    assert_eq!(
        decode(&cdb16(&[0x42, 0, 0, 0, 0, 0, 0, 0, 24]), &thick),
        Err(Sense::invalid_opcode())
    );
    let ro = LunInfo {
        read_only: true,
        ..lun()
    };
    assert_eq!(
        decode(&cdb16(&[0x42, 0, 0, 0, 0, 0, 0, 0, 24]), &ro),
        Err(Sense::write_protected())
    );

    assert_eq!(parse_unmap(&[], &l), Ok(vec![]));
    assert_eq!(
        parse_unmap(&unmap_list(&[(5, 10), (0, 0),]), &l),
        Ok(vec![(5, 10)])
    );
    assert_eq!(
        parse_unmap(&[0; 7], &l),
        Err(Sense::parameter_list_length_error())
    );
    let e = parse_unmap(&unmap_list(&[(1, 1), (2, 2), (3, 3)]), &l).unwrap_err();
    assert_eq!((e.asc, e.ascq), (0x26, 0));
    let e = parse_unmap(&unmap_list(&[(1, 60), (100, 41)]), &l).unwrap_err();
    assert_eq!(
        e.field,
        Some(FieldPointer {
            cdb: false,
            byte: 32,
            bit: Some(7)
        })
    );
    assert_eq!(
        parse_unmap(&unmap_list(&[((1 << 20) - 1, 2)]), &l),
        Err(Sense::lba_out_of_range())
    );
    let mut short = unmap_list(&[(1, 1)]);
    short.truncate(20);
    assert_eq!(parse_unmap(&short, &l).unwrap_err().asc, 0x26);
}

#[test]
fn get_lba_status() {
    let l = lun();
    assert_eq!(
        decode(
            &cdb16(&[0x9E, 0x12, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 24]),
            &l
        ),
        Ok(Command::GetLbaStatus {
            lba: 9,
            alloc_len: 24
        })
    );
    assert_eq!(
        decode(
            &cdb16(&[0x9E, 0x12, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 24]),
            &l
        ),
        Err(Sense::lba_out_of_range())
    );
    let d = lba_status(9, &[(3, false), (5, true)], 1000);
    assert_eq!(d.len(), 40);
    assert_eq!(&d[..8], &[0, 0, 0, 36, 0, 0, 0, 0]);
    assert_eq!(&d[8..24], &[0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 3, 0, 0, 0, 0]);
    assert_eq!(
        &d[24..40],
        &[0, 0, 0, 0, 0, 0, 0, 12, 0, 0, 0, 5, 1, 0, 0, 0]
    );
    let d = lba_status(9, &[(3, false), (5, true)], 24);
    assert_eq!(d.len(), 24);
    assert_eq!(&d[..4], &[0, 0, 0, 36]);
    let d = lba_status(0, &[(1 << 33, true)], 1000);
    assert_eq!(d.len(), 8 + 3 * 16);
}

#[test]
fn verify_and_write_and_verify() {
    let l = lun();
    assert_eq!(
        decode(&cdb16(&[0x2F, 0x02, 0, 0, 0, 4, 0, 0, 2]), &l),
        Ok(Command::Verify {
            lba: 4,
            blocks: 2,
            bytchk: true
        })
    );
    assert_eq!(
        decode(&cdb16(&[0xAF, 0, 0, 0, 0, 4, 0, 0, 0, 2]), &l),
        Ok(Command::Verify {
            lba: 4,
            blocks: 2,
            bytchk: false
        })
    );
    assert_eq!(
        decode(
            &cdb16(&[0x8F, 0x10, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 2]),
            &l
        ),
        Ok(Command::Verify {
            lba: 4,
            blocks: 2,
            bytchk: false
        })
    );
    // VRPROTECT, BYTCHK 10b/11b, DPO without DPOFUA, beyond the end.
    for b1 in [0x20, 0x40, 0xE0, 0x04, 0x06] {
        assert_eq!(
            decode(&cdb16(&[0x2F, b1, 0, 0, 0, 0, 0, 0, 1]), &l)
                .unwrap_err()
                .asc,
            0x24
        );
    }
    let nofua = LunInfo {
        fua: false,
        ..lun()
    };
    assert_eq!(
        decode(&cdb16(&[0x2F, 0x10, 0, 0, 0, 0, 0, 0, 1]), &nofua),
        Err(Sense::invalid_cdb_field(1, 4))
    );
    assert_eq!(
        decode(&cdb16(&[0x2F, 0, 0, 0x10, 0, 0, 0, 0, 1]), &l),
        Err(Sense::lba_out_of_range())
    );
    // Verifying a read-only LUN is fine; WRITE AND VERIFY is not.
    let ro = LunInfo {
        read_only: true,
        ..lun()
    };
    assert!(decode(&cdb16(&[0x2F, 0, 0, 0, 0, 0, 0, 0, 1]), &ro).is_ok());
    assert_eq!(
        decode(&cdb16(&[0x2E, 0x02, 0, 0, 0, 0, 0, 0, 1]), &ro),
        Err(Sense::write_protected())
    );
    assert_eq!(
        decode(&cdb16(&[0x2E, 0x02, 0, 0, 0, 9, 0, 0, 3]), &l),
        Ok(Command::WriteAndVerify { lba: 9, blocks: 3 })
    );
    assert_eq!(
        decode(&cdb16(&[0xAE, 0, 0, 0, 0, 9, 0, 0, 0, 3]), &l),
        Ok(Command::WriteAndVerify { lba: 9, blocks: 3 })
    );
    assert_eq!(
        decode(
            &cdb16(&[0x8E, 0x04, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]),
            &l
        )
        .unwrap_err()
        .asc,
        0x24
    );
    assert_eq!(
        Command::Verify {
            lba: 0,
            blocks: 3,
            bytchk: true
        }
        .data_out_len(512),
        1536
    );
    assert_eq!(
        Command::Verify {
            lba: 0,
            blocks: 3,
            bytchk: false
        }
        .data_out_len(512),
        0
    );
}

#[test]
fn write_same() {
    let l = LunInfo {
        max_write_same_blocks: 1000,
        ..lun()
    };
    assert_eq!(
        decode(&cdb16(&[0x41, 0x08, 0, 0, 0, 5, 0, 0, 10]), &l),
        Ok(Command::WriteSame {
            lba: 5,
            blocks: 10,
            unmap: true,
            ndob: false
        })
    );
    assert_eq!(
        decode(
            &cdb16(&[0x93, 0x01, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0x03, 0xE8]),
            &l
        ),
        Ok(Command::WriteSame {
            lba: 5,
            blocks: 1000,
            unmap: false,
            ndob: true
        })
    );
    assert_eq!(
        Command::WriteSame {
            lba: 5,
            blocks: 10,
            unmap: false,
            ndob: false
        }
        .data_out_len(4096),
        4096
    );
    assert_eq!(
        Command::WriteSame {
            lba: 5,
            blocks: 10,
            unmap: false,
            ndob: true
        }
        .data_out_len(4096),
        0
    );
    // WSNZ: zero blocks; beyond MAXIMUM WRITE SAME LENGTH; ANCHOR; PBDATA; NDOB bit in (10).
    assert_eq!(
        decode(&cdb16(&[0x41, 0, 0, 0, 0, 0, 0, 0, 0]), &l),
        Err(Sense::invalid_cdb_field(7, 7))
    );
    assert_eq!(
        decode(
            &cdb16(&[0x93, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x03, 0xE9]),
            &l
        ),
        Err(Sense::invalid_cdb_field(10, 7))
    );
    assert_eq!(
        decode(&cdb16(&[0x41, 0x18, 0, 0, 0, 0, 0, 0, 1]), &l),
        Err(Sense::invalid_cdb_field(1, 4))
    );
    assert_eq!(
        decode(&cdb16(&[0x41, 0x10, 0, 0, 0, 0, 0, 0, 1]), &l),
        Err(Sense::invalid_cdb_field(1, 4))
    );
    assert_eq!(
        decode(&cdb16(&[0x41, 0x04, 0, 0, 0, 0, 0, 0, 1]), &l),
        Err(Sense::invalid_cdb_field(1, 2))
    );
    assert_eq!(
        decode(&cdb16(&[0x41, 0x01, 0, 0, 0, 0, 0, 0, 1]), &l),
        Err(Sense::invalid_cdb_field(1, 0))
    );
    // Range, UNMAP without provisioning, read-only.
    assert_eq!(
        decode(&cdb16(&[0x41, 0, 0, 0x0F, 0xFF, 0xFF, 0, 0, 2]), &l),
        Err(Sense::lba_out_of_range())
    );
    let thick = LunInfo {
        unmap: false,
        ..l.clone()
    };
    assert_eq!(
        decode(&cdb16(&[0x41, 0x08, 0, 0, 0, 0, 0, 0, 1]), &thick),
        Err(Sense::invalid_cdb_field(1, 3))
    );
    let ro = LunInfo {
        read_only: true,
        ..l.clone()
    };
    assert_eq!(
        decode(&cdb16(&[0x41, 0, 0, 0, 0, 0, 0, 0, 1]), &ro),
        Err(Sense::write_protected())
    );
    // Read-only wins over "no provisioning" for WRITE SAME with UNMAP and for UNMAP.
    let ro_thick = LunInfo {
        read_only: true,
        ..thick
    };
    assert_eq!(
        decode(&cdb16(&[0x41, 0x08, 0, 0, 0, 0, 0, 0, 1]), &ro_thick),
        Err(Sense::write_protected())
    );
    assert_eq!(
        decode(&cdb16(&[0x42, 0, 0, 0, 0, 0, 0, 0, 24]), &ro_thick),
        Err(Sense::write_protected())
    );
}

#[test]
fn compare_and_write() {
    let l = LunInfo {
        max_compare_write_blocks: 4,
        ..lun()
    };
    let mut c = cdb16(&[0x89, 0x08]);
    c[9] = 7;
    c[13] = 4;
    assert_eq!(
        decode(&c, &l),
        Ok(Command::CompareAndWrite {
            lba: 7,
            blocks: 4,
            fua: true
        })
    );
    assert_eq!(
        Command::CompareAndWrite {
            lba: 7,
            blocks: 4,
            fua: true
        }
        .data_out_len(512),
        4096
    );
    c[13] = 5;
    assert_eq!(decode(&c, &l), Err(Sense::invalid_cdb_field(13, 7)));
    c[13] = 1;
    c[1] = 0x08;
    let nofua = LunInfo {
        fua: false,
        ..l.clone()
    };
    assert_eq!(decode(&c, &nofua), Err(Sense::invalid_cdb_field(1, 3)));
    c[1] = 0;
    c[2..10].copy_from_slice(&(1u64 << 20).to_be_bytes());
    assert_eq!(decode(&c, &l), Err(Sense::lba_out_of_range()));
    let none = LunInfo {
        max_compare_write_blocks: 0,
        ..lun()
    };
    assert_eq!(decode(&c, &none), Err(Sense::invalid_opcode()));
}

#[test]
fn copy_pr_and_misc_cdbs() {
    let l = LunInfo {
        copy: true,
        ..lun()
    };
    let mut c = cdb16(&[0x83]);
    c[13] = 60;
    assert_eq!(decode(&c, &l), Ok(Command::ExtendedCopy { param_len: 60 }));
    assert_eq!(decode(&c, &lun()), Err(Sense::invalid_opcode()));
    c[1] = 1;
    assert_eq!(decode(&c, &l), Err(Sense::invalid_cdb_field(1, 4)));
    let mut c = cdb16(&[0x84, 0x03, 9]);
    c[13] = 255;
    assert_eq!(
        decode(&c, &l),
        Ok(Command::ReceiveCopyResults {
            service_action: 3,
            list_id: 9,
            alloc_len: 255
        })
    );
    c[1] = 1;
    assert_eq!(decode(&c, &l), Err(Sense::invalid_cdb_field(1, 4)));

    assert_eq!(
        decode(&cdb16(&[0x5E, 0x03, 0, 0, 0, 0, 0, 0x10, 0]), &l),
        Ok(Command::PersistentReserveIn {
            service_action: 3,
            alloc_len: 4096
        })
    );
    for sa in 4..0x20 {
        assert_eq!(
            decode(&cdb16(&[0x5E, sa, 0, 0, 0, 0, 0, 0x10, 0]), &l),
            Err(Sense::invalid_cdb_field(1, 4))
        );
    }
    assert_eq!(
        decode(&cdb16(&[0x5F, 0x01, 0x03, 0, 0, 0, 0, 0, 24]), &l),
        Ok(Command::PersistentReserveOut {
            service_action: 1,
            scope: 0,
            kind: 3,
            param_len: 24
        })
    );
    assert_eq!(
        decode(&cdb16(&[0x5F, 0x07, 0, 0, 0, 0, 0, 0, 24]), &l),
        Err(Sense::invalid_cdb_field(1, 4))
    );
    assert_eq!(
        decode(&cdb16(&[0x5F, 0x00, 0, 0, 0, 0, 0, 0, 23]), &l),
        Err(Sense::parameter_list_length_error())
    );

    assert_eq!(
        decode(&cdb16(&[0x1B, 0, 0, 0, 0x01]), &l),
        Ok(Command::StartStopUnit {
            start: true,
            loej: false
        })
    );
    assert_eq!(
        decode(&cdb16(&[0x1E, 0, 0, 0, 0x01]), &l),
        Ok(Command::PreventAllowMediumRemoval { prevent: 1 })
    );
    assert_eq!(
        decode(&cdb16(&[0x34, 0x02, 0, 0, 0, 1, 0x03, 0, 1]), &l),
        Ok(Command::PreFetch { lba: 1, blocks: 1 })
    );
    assert_eq!(
        decode(&cdb16(&[0x34, 0, 0, 0x10, 0, 1, 0, 0, 0]), &l),
        Err(Sense::lba_out_of_range())
    );
    assert_eq!(
        decode(&cdb16(&[0x90, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]), &l),
        Ok(Command::PreFetch { lba: 1, blocks: 0 })
    );
    assert_eq!(
        decode(&cdb16(&[0x37, 0, 0x18, 0, 0, 0, 0, 0, 32]), &l),
        Ok(Command::DataIn(vec![0, 0x18, 0, 0]))
    );
    assert_eq!(
        decode(&cdb16(&[0xB7, 0x0D, 0, 0, 0, 0, 0, 0, 0, 32]), &l),
        Ok(Command::DataIn(vec![0, 0x0D, 0, 0, 0, 0, 0, 0]))
    );
    // RESERVE(6)/RELEASE(6) and SANITIZE are not supported.
    for o in [0x16, 0x17, 0x48] {
        assert_eq!(decode(&cdb16(&[o]), &l), Err(Sense::invalid_opcode()));
    }
    assert!(Command::Unmap { param_len: 24 }.writes());
    assert!(!Command::Verify {
        lba: 0,
        blocks: 1,
        bytchk: true
    }
    .writes());
}

#[test]
fn absent_lun() {
    let l = lun();
    let d = match decode_absent(&cdb16(&[0x12, 0, 0, 0, 36]), &l) {
        Ok(Command::DataIn(d)) => d,
        other => panic!("{other:?}"),
    };
    assert_eq!(d.len(), 36);
    assert_eq!(d[0], 0x7F);
    assert_eq!(
        decode_absent(&cdb16(&[0xA0, 0, 0, 0, 0, 0, 0, 0, 1, 0]), &l),
        Ok(Command::ReportLuns { alloc_len: 256 })
    );
    match decode_absent(&cdb16(&[0x03, 0, 0, 0, 18]), &l) {
        Ok(Command::DataIn(d)) => assert_eq!((d[2], d[12], d[13]), (5, 0x25, 0)),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        decode_absent(&cdb16(&[0x28]), &l),
        Err(Sense::lun_not_supported())
    );
    assert_eq!(
        decode_absent(&cdb16(&[0x12, 1, 0x80, 0, 36]), &l),
        Err(Sense::lun_not_supported())
    );
    assert_eq!(decode_absent(&[], &l), Err(Sense::invalid_opcode()));
}
