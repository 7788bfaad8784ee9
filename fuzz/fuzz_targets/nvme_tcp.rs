//! The NVMe/TCP PDU codec (crates/wire/src/nvme_tcp.rs). The first input byte picks what a
//! connection negotiated (direction, header and data digests, alignment, the receiver's PLEN
//! bound); the rest is walked PDU by PDU the way a receiver walks its buffer. No panic on any
//! input; `Need(n)` always asks for more than is buffered and never more than the bound; a
//! complete PDU lies inside the buffer and within the bound, and every shorter prefix of it asks
//! for exactly the bytes it lacks; a PDU that decodes encodes again to the bytes it came from
//! (decoding is strict, so that holds for every one). Submission and completion entries and SGL
//! descriptors read from the same bytes round-trip too.

#![no_main]

use blkwire_wire::nvme_tcp::{
    self, Cqe, Direction, Params, Progress, Sgl, Sqe, CH_LEN, CQE_LEN, SQE_LEN,
};
use libfuzzer_sys::fuzz_target;

fn params(b: u8) -> Params {
    Params {
        direction: if b & 1 == 0 {
            Direction::HostToController
        } else {
            Direction::ControllerToHost
        },
        hdgst: b & 2 != 0,
        ddgst: b & 4 != 0,
        pda: [0, 1, 7, 31][(b >> 3 & 3) as usize],
        max_plen: [128, 4096, 65536, 1 << 20][(b >> 5 & 3) as usize],
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, stream)) = data.split_first() else {
        return;
    };
    let p = params(first);
    let mut at = 0usize;
    let mut out = Vec::new();
    loop {
        let rx = &stream[at..];
        let len = match nvme_tcp::pdu_len(rx, &p) {
            Ok(Progress::Need(n)) => {
                assert!(n > rx.len(), "Need({n}) with {} bytes buffered", rx.len());
                assert!(n <= p.max_plen as usize, "Need({n}) beyond the bound");
                assert!(matches!(
                    nvme_tcp::decode(rx, &p),
                    Err(nvme_tcp::PduError::Short)
                ));
                break;
            }
            Ok(Progress::Complete(len)) => len,
            Err(e) => {
                let _ = (e.term_status(), e.to_string());
                assert_eq!(nvme_tcp::decode(rx, &p).unwrap_err(), e);
                break;
            }
        };
        assert!(len <= rx.len() && len <= p.max_plen as usize && len >= CH_LEN);
        for k in [0, CH_LEN - 1, CH_LEN, len / 2, len - 1] {
            if k < len {
                let want = if k < CH_LEN { CH_LEN } else { len };
                assert_eq!(
                    nvme_tcp::pdu_len(&rx[..k], &p),
                    Ok(Progress::Need(want)),
                    "{k}"
                );
            }
        }
        match nvme_tcp::decode(rx, &p) {
            Ok(pdu) => {
                out.clear();
                pdu.encode(&p, &mut out);
                assert_eq!(
                    &out[..],
                    &rx[..len],
                    "{pdu:?} did not re-encode to its bytes"
                );
            }
            // A receiver closes the connection here.
            Err(e) => {
                let _ = (e.term_status(), e.to_string());
                break;
            }
        }
        at += len;
    }

    if let Some(b) = stream.first_chunk::<SQE_LEN>() {
        let sqe = Sqe::parse(b);
        assert_eq!(&sqe.to_bytes(), b);
        let sgl = sqe.sgl();
        assert_eq!(Sgl::parse(&sgl.to_bytes()), sgl);
    }
    if let Some(b) = stream.first_chunk::<CQE_LEN>() {
        let cqe = Cqe::parse(b);
        assert_eq!(&cqe.to_bytes(), b);
        assert_eq!(cqe.status >> 1 & 0xff, cqe.sc() as u16);
    }
});
