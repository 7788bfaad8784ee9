//! The one place an export's capabilities become each protocol's flags: the native protocol's
//! feature bits (PROTOCOL.md §7) and NBD's transmission flags. Both come from
//! [`Export::capabilities`] (native or emulated, never the backend's raw declaration), so a
//! frontend advertises exactly what the export does. The initiator turns the native bits into
//! ublk parameters and FUSE/loop settings on its side (crates/map).

use blkwire_backend::{Capabilities, Export};
use blkwire_wire::nbd::tflag;
use blkwire_wire::Features;

/// What the flags depend on: capabilities plus export policy.
#[derive(Clone, Copy, Debug)]
pub struct Advertised {
    caps: Capabilities,
    read_only: bool,
    init_zero: bool,
}

impl Advertised {
    /// What `e` advertises right now (INIT_ZERO depends on its current contents).
    pub fn of(e: &Export) -> Advertised {
        Advertised {
            caps: e.capabilities(),
            read_only: e.read_only,
            init_zero: e.backend().reads_as_zero(),
        }
    }

    /// Native feature bits (PROTOCOL.md §7). TRIM, WRITE_ZEROES and COPY are always served on
    /// a writable export (natively or emulated); FLUSH only where the medium is durable. Whether
    /// a session may send COPY is its own grant (the HELLO reply's COPY limits, §13).
    pub fn native(&self) -> Features {
        let c = &self.caps;
        let mut f = 0;
        if self.read_only {
            f |= Features::READ_ONLY;
        } else {
            f |= Features::TRIM | Features::WRITE_ZEROES | Features::COPY;
        }
        if c.flush.available() {
            f |= Features::FLUSH;
        }
        if c.fua.available() {
            f |= Features::FUA;
        }
        if c.rotational {
            f |= Features::ROTATIONAL;
        }
        if self.init_zero {
            f |= Features::INIT_ZERO;
        }
        Features(f)
    }

    /// NBD transmission flags. CAN_MULTI_CONN holds for every backend: all connections share
    /// one backend object, a FLUSH is an fdatasync of the shared file (or nothing, for RAM that
    /// is never durable), and a write is visible to every connection once it is answered.
    pub fn nbd(&self, structured: bool) -> u16 {
        let c = &self.caps;
        let mut f = tflag::HAS_FLAGS | tflag::CAN_MULTI_CONN | tflag::SEND_CACHE;
        if c.flush.available() {
            f |= tflag::SEND_FLUSH;
        }
        if c.fua.available() {
            f |= tflag::SEND_FUA;
        }
        if c.rotational {
            f |= tflag::ROTATIONAL;
        }
        if self.read_only {
            f |= tflag::READ_ONLY;
        } else {
            f |= tflag::SEND_TRIM | tflag::SEND_WRITE_ZEROES;
            if c.fast_zero {
                f |= tflag::SEND_FAST_ZERO;
            }
        }
        if structured {
            f |= tflag::SEND_DF;
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkwire_backend::Support::{self, Emulated, Native, None};

    fn adv(flush: Support, fua: Support, fast_zero: bool, read_only: bool) -> Advertised {
        Advertised {
            caps: Capabilities {
                flush,
                fua,
                trim: Emulated,
                write_zeroes: Native,
                fast_zero,
                rotational: false,
                ..Capabilities::default()
            },
            read_only,
            init_zero: false,
        }
    }

    #[test]
    fn native_and_nbd_flags_table() {
        use blkwire_wire::Features as F;
        let base = tflag::HAS_FLAGS | tflag::CAN_MULTI_CONN | tflag::SEND_CACHE;
        let rw_nbd = tflag::SEND_TRIM | tflag::SEND_WRITE_ZEROES;
        #[rustfmt::skip]
        let table = [
            // a file: flush and FUA native, zeroing cheap
            (adv(Native, Native, true, false),
             F::TRIM | F::WRITE_ZEROES | F::COPY | F::FLUSH | F::FUA,
             base | rw_nbd | tflag::SEND_FLUSH | tflag::SEND_FUA | tflag::SEND_FAST_ZERO),
            // flush-only backend: FUA is emulated, and advertised
            (adv(Native, Emulated, false, false),
             F::TRIM | F::WRITE_ZEROES | F::COPY | F::FLUSH | F::FUA,
             base | rw_nbd | tflag::SEND_FLUSH | tflag::SEND_FUA),
            // RAM: volatile, neither FLUSH nor FUA
            (adv(None, None, true, false),
             F::TRIM | F::WRITE_ZEROES | F::COPY,
             base | rw_nbd | tflag::SEND_FAST_ZERO),
            // read-only: no modifying commands, fast zero irrelevant
            (adv(Native, Native, true, true),
             F::READ_ONLY | F::FLUSH | F::FUA,
             base | tflag::READ_ONLY | tflag::SEND_FLUSH | tflag::SEND_FUA),
        ];
        for (i, (a, native, nbd)) in table.into_iter().enumerate() {
            assert_eq!(
                a.native().0,
                native,
                "row {i}: native {:?}",
                a.native().names()
            );
            assert_eq!(a.nbd(false), nbd, "row {i}: nbd");
            assert_eq!(a.nbd(true), nbd | tflag::SEND_DF, "row {i}: nbd structured");
        }
    }

    #[test]
    fn rotational_and_initially_zero_exports_say_so() {
        let mut a = adv(None, None, false, false);
        a.caps.rotational = true;
        a.init_zero = true;
        assert!(a.native().has(Features::ROTATIONAL) && a.native().has(Features::INIT_ZERO));
        assert!(a.nbd(false) & tflag::ROTATIONAL != 0);
    }
}
