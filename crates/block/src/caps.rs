//! What an export can do, and how: natively, emulated by the generic layer, or not at all.
//!
//! A backend declares only what it does natively ([`Capabilities::native`] values: `Native` or
//! `None`). [`Capabilities::effective`] is the single rule for what the generic layer adds on
//! top, and every frontend advertises from its result, never from the backend's declaration.

/// How an export provides one capability.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Support {
    /// Not at all: requests for it are refused, or (FLUSH on a volatile medium) have nothing to do.
    #[default]
    None,
    /// By the generic layer on top of other operations (e.g. FUA as a write, then a flush).
    Emulated,
    /// By the backend itself.
    Native,
}

impl Support {
    /// True unless `None`: the capability may be advertised.
    pub fn available(self) -> bool {
        self != Support::None
    }

    /// `Native` when `native`, else `None`: how backends declare a capability.
    pub fn native_if(native: bool) -> Support {
        if native {
            Support::Native
        } else {
            Support::None
        }
    }
}

/// Largest ranges one backend operation of each kind may name: the generic layer splits longer
/// TRIM and WRITE_ZEROES requests into pieces this size, and refuses larger COPYs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest TRIM the backend takes at once.
    pub max_trim_bytes: u64,
    /// Largest WRITE_ZEROES the backend takes at once.
    pub max_zero_bytes: u64,
    /// Most bytes one COPY may move in all.
    pub max_copy_bytes: u64,
    /// Most source ranges one COPY may name.
    pub max_copy_ranges: u16,
}

impl Default for Limits {
    /// No limit beyond the protocol's own (a request's length is a u32).
    fn default() -> Limits {
        Limits {
            max_trim_bytes: u32::MAX as u64,
            max_zero_bytes: u32::MAX as u64,
            max_copy_bytes: u32::MAX as u64,
            max_copy_ranges: 128,
        }
    }
}

/// Capabilities of a backend (as declared) or of an export (as served).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// FLUSH makes answered writes durable. `None` means the medium is volatile by design
    /// (`mem:`, `null:`): FLUSH succeeds at once and nothing survives a restart.
    pub flush: Support,
    /// A WRITE can be made durable on its own (forced unit access).
    pub fua: Support,
    /// TRIM frees space.
    pub trim: Support,
    /// WRITE_ZEROES zeroes a range without the zeros crossing the wire.
    pub write_zeroes: Support,
    /// COPY moves data between ranges of the export inside the target.
    pub copy: Support,
    /// WRITE_ZEROES is a metadata operation, never a write of zeros (NBD's FAST_ZERO).
    pub fast_zero: bool,
    /// The medium seeks (spinning disk).
    pub rotational: bool,
    /// Request size limits.
    pub limits: Limits,
}

impl Capabilities {
    /// What an export serves on top of a backend that declares `native`. The rules:
    /// - FLUSH exists only where the backend has a durable medium (it has native flush);
    /// - FUA is native, else emulated as a write followed by a flush where flush exists;
    /// - TRIM is native, else emulated as advisory (it completes and changes nothing);
    /// - WRITE_ZEROES is native, else emulated by writing zeros inside the target;
    /// - COPY is native, else emulated by reads and writes inside the target (never over the
    ///   wire);
    /// - FAST_ZERO only where zeroing is native and the backend says it is metadata-only.
    pub fn effective(native: Capabilities) -> Capabilities {
        let native_only = |s: Support| Support::native_if(s == Support::Native);
        let or_emulated = |s: Support| {
            if s == Support::Native {
                Support::Native
            } else {
                Support::Emulated
            }
        };
        let flush = native_only(native.flush);
        let fua = match (native.fua, flush) {
            (Support::Native, _) => Support::Native,
            (_, Support::Native) => Support::Emulated,
            _ => Support::None,
        };
        let write_zeroes = or_emulated(native.write_zeroes);
        Capabilities {
            flush,
            fua,
            trim: or_emulated(native.trim),
            write_zeroes,
            copy: or_emulated(native.copy),
            fast_zero: native.fast_zero && write_zeroes == Support::Native,
            rotational: native.rotational,
            limits: native.limits,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Support::{Emulated, Native, None};
    use super::*;

    fn declared(flush: bool, fua: bool, trim: bool, zero: bool, fast: bool) -> Capabilities {
        Capabilities {
            flush: Support::native_if(flush),
            fua: Support::native_if(fua),
            trim: Support::native_if(trim),
            write_zeroes: Support::native_if(zero),
            fast_zero: fast,
            ..Capabilities::default()
        }
    }

    /// (declared flush, fua, trim, zero, fast_zero) -> effective (flush, fua, trim, zero, fast_zero)
    #[test]
    fn effective_capabilities_table() {
        #[rustfmt::skip]
        let table = [
            // a file: everything native
            ((true, true, true, true, true), (Native, Native, Native, Native, true)),
            // flush but no FUA (librbd-like): FUA emulated as write then flush
            ((true, false, false, false, false), (Native, Emulated, Emulated, Emulated, false)),
            // RAM: volatile, zeroing native and cheap
            ((false, false, true, true, true), (None, None, Native, Native, true)),
            // FUA without flush is still FUA
            ((false, true, false, false, false), (None, Native, Emulated, Emulated, false)),
            // fast zero claimed without native zeroing: not advertised
            ((false, false, false, false, true), (None, None, Emulated, Emulated, false)),
        ];
        for ((fl, fu, tr, ze, fa), want) in table {
            let e = Capabilities::effective(declared(fl, fu, tr, ze, fa));
            assert_eq!(
                (e.flush, e.fua, e.trim, e.write_zeroes, e.fast_zero),
                want,
                "declared flush={fl} fua={fu} trim={tr} zero={ze} fast={fa}"
            );
        }
    }

    #[test]
    fn copy_is_always_served_natively_or_emulated() {
        let mut d = declared(false, false, false, false, false);
        assert_eq!(Capabilities::effective(d).copy, Emulated);
        d.copy = Native;
        assert_eq!(Capabilities::effective(d).copy, Native);
    }

    #[test]
    fn emulated_values_in_a_declaration_are_not_trusted() {
        let mut d = declared(false, false, false, false, false);
        d.flush = Emulated;
        assert_eq!(Capabilities::effective(d).flush, None);
        assert!(!None.available() && Emulated.available() && Native.available());
    }
}
