//! The SCSI command layer (crates/wire/src/scsi/): `decode` on arbitrary CDBs for LUNs of
//! several shapes, the UNMAP and EXTENDED COPY parameter lists, and persistent reservations
//! driven by a stream of PERSISTENT RESERVE OUT records from three initiators. No panic on any
//! input; every READ/WRITE-like command that decodes lies inside the LUN and within MAXIMUM
//! TRANSFER LENGTH, writes never decode on a read-only LUN, data-in answers never exceed the
//! allocation length, parsed lists stay within the limits they are held to.

#![no_main]

use blkwire_wire::scsi::{self, pr, xcopy, Command, LunInfo};
use libfuzzer_sys::fuzz_target;

fn lun(b: u8) -> LunInfo {
    LunInfo {
        blocks: [0, 1, 1000, 1 << 40][(b & 3) as usize],
        block_size: if b & 4 != 0 { 4096 } else { 512 },
        read_only: b & 8 != 0,
        fua: b & 16 != 0,
        unmap: b & 32 != 0,
        copy: b & 64 != 0,
        max_transfer_blocks: if b & 128 != 0 { 0 } else { 2048 },
        max_unmap_descriptors: 4,
        max_unmap_blocks: 5000,
        max_compare_write_blocks: 8,
        naa: scsi::naa_registered(0x001405, u64::from(b)),
        serial: "fuzz".into(),
        ..LunInfo::default()
    }
}

/// The allocation length a data-in CDB names, where it sits for each opcode.
fn alloc_len(cdb: &[u8]) -> Option<usize> {
    let be = |r: std::ops::Range<usize>| cdb[r].iter().fold(0usize, |a, &b| a << 8 | b as usize);
    Some(match cdb[0] {
        0x03 | 0x1A => cdb[4] as usize,
        0x12 => be(3..5),
        0x5A | 0x37 => be(7..9),
        0x9E => be(10..14),
        0xA3 | 0xB7 => be(6..10),
        0x25 => 8,
        _ => return None,
    })
}

fn alloc_len_of(cdb: &[u8]) -> Option<usize> {
    if cdb.len() < 16 {
        return None;
    }
    alloc_len(cdb)
}

fn check_decode(cdb: &[u8], l: &LunInfo) {
    let Ok(cmd) = scsi::decode(cdb, l) else {
        return;
    };
    let limit = if l.max_transfer_blocks == 0 {
        u32::MAX
    } else {
        l.max_transfer_blocks
    };
    let inside = |lba: u64, n: u32| lba.checked_add(u64::from(n)).is_some_and(|e| e <= l.blocks);
    match cmd {
        Command::Read { lba, blocks, .. }
        | Command::Write { lba, blocks, .. }
        | Command::WriteAndVerify { lba, blocks }
        | Command::Verify { lba, blocks, .. } => {
            assert!(inside(lba, blocks) && blocks <= limit, "{cdb:02x?}");
        }
        Command::WriteSame {
            lba, blocks, unmap, ..
        } => {
            assert!(inside(lba, blocks) && blocks > 0 && (!unmap || l.unmap));
        }
        Command::CompareAndWrite { lba, blocks, .. } => {
            assert!(inside(lba, blocks) && blocks <= u32::from(l.max_compare_write_blocks));
        }
        Command::SynchronizeCache { lba, blocks } | Command::PreFetch { lba, blocks } => {
            assert!(inside(lba, blocks));
        }
        Command::GetLbaStatus { lba, .. } => assert!(lba < l.blocks),
        Command::DataIn(ref d) => {
            if let Some(a) = alloc_len(cdb) {
                assert!(d.len() <= a, "{cdb:02x?}: {} > {a}", d.len());
            }
        }
        Command::Unmap { .. } | Command::ExtendedCopy { .. } => {}
        _ => {}
    }
    if l.read_only {
        assert!(
            !cmd.writes()
                || matches!(
                    cmd,
                    Command::ExtendedCopy { .. } | Command::SynchronizeCache { .. }
                )
        );
    }
    let _ = cmd.data_out_len(l.block_size);
}

fuzz_target!(|data: &[u8]| {
    let Some((&shape, rest)) = data.split_first() else {
        return;
    };
    let l = lun(shape);

    // CDBs: the whole input, and 16-byte windows of it.
    check_decode(rest, &l);
    for w in rest.chunks(16) {
        check_decode(w, &l);
        if let (Ok(Command::DataIn(d)), Some(a)) = (scsi::decode_absent(w, &l), alloc_len_of(w)) {
            assert!(d.len() <= a);
        }
    }

    // UNMAP parameter list.
    if let Ok(ext) = scsi::parse_unmap(rest, &l) {
        assert!(ext.len() <= l.max_unmap_descriptors as usize);
        let total: u64 = ext.iter().map(|&(_, n)| u64::from(n)).sum();
        assert!(total <= u64::from(l.max_unmap_blocks));
        for (lba, n) in ext {
            assert!(n > 0 && lba + u64::from(n) <= l.blocks);
        }
    }

    // EXTENDED COPY parameter list, checked against this LUN.
    let limits = xcopy::Limits::default();
    if let Ok(plan) = xcopy::parse(rest, &limits) {
        assert!(plan.targets.len() <= usize::from(limits.max_target_descriptors));
        assert!(plan.segments.len() <= usize::from(limits.max_segment_descriptors));
        for s in &plan.segments {
            assert!(
                usize::from(s.src) < plan.targets.len() && usize::from(s.dst) < plan.targets.len()
            );
        }
        if plan
            .check(&limits, |t| (t.naa == l.naa).then_some(&l))
            .is_ok()
        {
            for s in &plan.segments {
                assert!(s.src_lba + u64::from(s.blocks) <= l.blocks);
                assert!(s.dst_lba + u64::from(s.blocks) <= l.blocks && !l.read_only);
            }
        }
    }
    let _ = xcopy::operating_parameters(&limits, u32::from(shape));

    // Persistent reservations: records of [initiator, service action, scope/type, 24 bytes].
    let mut res = pr::Reservations::new();
    let nexus: Vec<pr::Nexus> = (0..3)
        .map(|i| pr::Nexus {
            initiator: format!("iqn.fuzz:{i},i,0x00023d00000{i}"),
            target_port: i,
        })
        .collect();
    for r in rest.chunks(3 + pr::PARAM_LEN) {
        let who = &nexus[usize::from(r[0] % 3)];
        let sa = r.get(1).copied().unwrap_or(0) & 0x1F;
        let st = r.get(2).copied().unwrap_or(0);
        let params = r.get(3..).unwrap_or(&[]);
        let before = res.generation();
        let out = res.reserve_out(who, sa, st >> 4, st & 0x0F, params);
        if out.is_err() {
            assert_eq!(res.generation(), before);
        }
        for sa in 0..4 {
            for alloc in [0u32, 8, 4096] {
                let b = res.reserve_in(sa, alloc).unwrap();
                assert!(b.len() <= alloc as usize);
            }
        }
        let keys = res.reserve_in(0, u32::MAX).unwrap();
        assert!(keys.len() <= 8 + 8 * pr::MAX_REGISTRATIONS);
        for n in &nexus {
            let _ = res.conflicts(
                n,
                &Command::Read {
                    lba: 0,
                    blocks: 1,
                    fua: false,
                },
            );
            let _ = res.conflicts(
                n,
                &Command::Write {
                    lba: 0,
                    blocks: 1,
                    fua: false,
                },
            );
        }
    }

    // Answers built from numbers.
    let luns: Vec<u64> = rest
        .chunks(8)
        .map(|c| c.iter().fold(0u64, |a, &b| a << 8 | u64::from(b)))
        .collect();
    let alloc = u32::from(shape) * 3;
    assert!(scsi::report_luns(&luns, alloc).len() <= alloc as usize);
    for &n in &luns {
        assert_eq!(
            scsi::lun_from_wire(scsi::lun_to_wire(n & 0x3FFF)),
            n & 0x3FFF
        );
    }
    let ext: Vec<(u64, bool)> = luns.iter().map(|&n| (n, n & 1 != 0)).collect();
    assert!(
        scsi::lba_status(luns.first().copied().unwrap_or(0), &ext, alloc).len() <= alloc as usize
    );
});
