//! Sense data (SPC-4 4.5): what a CHECK CONDITION carries. Encoded in fixed format (response
//! code 70h, SPC-4 4.5.3) unless the caller asks for descriptor format (72h, SPC-4 4.5.2) through
//! REQUEST SENSE with DESC=1; the control mode page reports D_SENSE=0, so fixed format is what
//! every CHECK CONDITION carries.

/// Sense keys (SPC-4 4.5.6).
pub mod key {
    /// NO SENSE.
    pub const NO_SENSE: u8 = 0x0;
    /// NOT READY.
    pub const NOT_READY: u8 = 0x2;
    /// MEDIUM ERROR.
    pub const MEDIUM_ERROR: u8 = 0x3;
    /// HARDWARE ERROR.
    pub const HARDWARE_ERROR: u8 = 0x4;
    /// ILLEGAL REQUEST.
    pub const ILLEGAL_REQUEST: u8 = 0x5;
    /// UNIT ATTENTION.
    pub const UNIT_ATTENTION: u8 = 0x6;
    /// DATA PROTECT.
    pub const DATA_PROTECT: u8 = 0x7;
    /// COPY ABORTED.
    pub const COPY_ABORTED: u8 = 0xA;
    /// ABORTED COMMAND.
    pub const ABORTED_COMMAND: u8 = 0xB;
    /// MISCOMPARE.
    pub const MISCOMPARE: u8 = 0xE;
}

/// Bytes of fixed-format sense data as [`Sense::encode`] writes it (additional length 10).
pub const FIXED_LEN: usize = 18;

/// Where in the CDB or parameter list the offending field is: the sense-key specific field
/// pointer of SPC-4 sense data (SKSV=1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FieldPointer {
    /// C/D: true when the field is in the CDB, false when in the parameter list (Data-Out).
    pub cdb: bool,
    /// Byte of the field.
    pub byte: u16,
    /// Bit of the field (its most significant bit), when known (BPV=1).
    pub bit: Option<u8>,
}

/// One CHECK CONDITION's sense data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sense {
    /// Sense key ([`key`]).
    pub key: u8,
    /// ADDITIONAL SENSE CODE.
    pub asc: u8,
    /// ADDITIONAL SENSE CODE QUALIFIER.
    pub ascq: u8,
    /// INFORMATION (VALID=1 when present): e.g. the offset of the first miscompare.
    pub info: Option<u64>,
    /// Sense-key specific field pointer (ILLEGAL REQUEST, COPY ABORTED).
    pub field: Option<FieldPointer>,
}

impl Sense {
    /// Sense with key, ASC and ASCQ and nothing else.
    pub const fn new(key: u8, asc: u8, ascq: u8) -> Sense {
        Sense {
            key,
            asc,
            ascq,
            info: None,
            field: None,
        }
    }

    /// The same sense with a field pointer into the CDB (`byte`, `bit` = most significant bit
    /// of the field).
    pub fn at_cdb(mut self, byte: u16, bit: u8) -> Sense {
        self.field = Some(FieldPointer {
            cdb: true,
            byte,
            bit: Some(bit & 7),
        });
        self
    }

    /// The same sense with a field pointer into the parameter list.
    pub fn at_param(mut self, byte: u16, bit: Option<u8>) -> Sense {
        self.field = Some(FieldPointer {
            cdb: false,
            byte,
            bit: bit.map(|b| b & 7),
        });
        self
    }

    /// NO SENSE, 00h/00h: what REQUEST SENSE answers with nothing pending.
    pub const fn no_sense() -> Sense {
        Sense::new(key::NO_SENSE, 0, 0)
    }
    /// ILLEGAL REQUEST, INVALID COMMAND OPERATION CODE (20h/00h).
    pub const fn invalid_opcode() -> Sense {
        Sense::new(key::ILLEGAL_REQUEST, 0x20, 0x00)
    }
    /// ILLEGAL REQUEST, INVALID FIELD IN CDB (24h/00h), without a field pointer.
    pub const fn invalid_field_in_cdb() -> Sense {
        Sense::new(key::ILLEGAL_REQUEST, 0x24, 0x00)
    }
    /// ILLEGAL REQUEST, INVALID FIELD IN CDB (24h/00h) pointing at `byte`, bit `bit`.
    pub fn invalid_cdb_field(byte: u16, bit: u8) -> Sense {
        Sense::invalid_field_in_cdb().at_cdb(byte, bit)
    }
    /// ILLEGAL REQUEST, LOGICAL BLOCK ADDRESS OUT OF RANGE (21h/00h).
    pub const fn lba_out_of_range() -> Sense {
        Sense::new(key::ILLEGAL_REQUEST, 0x21, 0x00)
    }
    /// DATA PROTECT, SPACE ALLOCATION FAILED WRITE PROTECT (27h/07h): a thin LU out of space
    /// (SBC-3 4.7.3.7; Linux reads it as ENOSPC).
    pub const fn space_allocation_failed() -> Sense {
        Sense::new(key::DATA_PROTECT, 0x27, 0x07)
    }
    /// DATA PROTECT, WRITE PROTECTED (27h/00h).
    pub const fn write_protected() -> Sense {
        Sense::new(key::DATA_PROTECT, 0x27, 0x00)
    }
    /// MISCOMPARE, MISCOMPARE DURING VERIFY OPERATION (1Dh/00h); INFORMATION is the offset in
    /// bytes of the first byte that differs (SBC-3 COMPARE AND WRITE, VERIFY).
    pub const fn miscompare(offset: u64) -> Sense {
        Sense {
            key: key::MISCOMPARE,
            asc: 0x1D,
            ascq: 0x00,
            info: Some(offset),
            field: None,
        }
    }
    /// ILLEGAL REQUEST, INVALID FIELD IN PARAMETER LIST (26h/00h).
    pub const fn invalid_field_in_parameter_list() -> Sense {
        Sense::new(key::ILLEGAL_REQUEST, 0x26, 0x00)
    }
    /// ILLEGAL REQUEST, PARAMETER LIST LENGTH ERROR (1Ah/00h).
    pub const fn parameter_list_length_error() -> Sense {
        Sense::new(key::ILLEGAL_REQUEST, 0x1A, 0x00)
    }
    /// MEDIUM ERROR, UNRECOVERED READ ERROR (11h/00h).
    pub const fn medium_error() -> Sense {
        Sense::new(key::MEDIUM_ERROR, 0x11, 0x00)
    }
    /// MEDIUM ERROR, WRITE ERROR (0Ch/00h).
    pub const fn write_error() -> Sense {
        Sense::new(key::MEDIUM_ERROR, 0x0C, 0x00)
    }
    /// ILLEGAL REQUEST, LOGICAL UNIT NOT SUPPORTED (25h/00h): a LUN the target does not have.
    pub const fn lun_not_supported() -> Sense {
        Sense::new(key::ILLEGAL_REQUEST, 0x25, 0x00)
    }
    /// UNIT ATTENTION, REPORTED LUNS DATA HAS CHANGED (3Fh/0Eh): a LUN of the target was
    /// added or removed (SPC-4 REPORT LUNS).
    pub const fn reported_luns_changed() -> Sense {
        Sense::new(key::UNIT_ATTENTION, 0x3F, 0x0E)
    }
    /// ILLEGAL REQUEST, SAVING PARAMETERS NOT SUPPORTED (39h/00h): MODE SENSE of saved values.
    pub const fn saving_not_supported() -> Sense {
        Sense::new(key::ILLEGAL_REQUEST, 0x39, 0x00)
    }
    /// ABORTED COMMAND, with no additional sense: the task was ended by the transport.
    pub const fn aborted() -> Sense {
        Sense::new(key::ABORTED_COMMAND, 0, 0)
    }

    /// Appends the 18 bytes of fixed-format sense data (SPC-4 4.5.3): response code 70h,
    /// VALID and INFORMATION (bytes 3..7) when `info` fits 32 bits, ADDITIONAL SENSE LENGTH 10,
    /// ASC/ASCQ at bytes 12/13, the field pointer (SKSV) at bytes 15..18.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut b = [0u8; FIXED_LEN];
        b[0] = 0x70;
        if let Some(info) = self.info.and_then(|i| u32::try_from(i).ok()) {
            b[0] |= 0x80;
            b[3..7].copy_from_slice(&info.to_be_bytes());
        }
        b[2] = self.key & 0x0F;
        b[7] = (FIXED_LEN - 8) as u8;
        b[12] = self.asc;
        b[13] = self.ascq;
        if let Some(f) = self.field {
            b[15] = 0x80 | if f.cdb { 0x40 } else { 0 };
            if let Some(bit) = f.bit {
                b[15] |= 0x08 | (bit & 7);
            }
            b[16..18].copy_from_slice(&f.byte.to_be_bytes());
        }
        out.extend_from_slice(&b);
    }

    /// Appends descriptor-format sense data (SPC-4 4.5.2): response code 72h, then an
    /// information descriptor (00h) when `info` is set and a sense key specific descriptor
    /// (02h) when a field pointer is set.
    pub fn encode_descriptor(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&[0x72, self.key & 0x0F, self.asc, self.ascq, 0, 0, 0, 0]);
        if let Some(info) = self.info {
            out.extend_from_slice(&[0x00, 0x0A, 0x80, 0]);
            out.extend_from_slice(&info.to_be_bytes());
        }
        if let Some(f) = self.field {
            let mut b0 = 0x80 | if f.cdb { 0x40 } else { 0 };
            if let Some(bit) = f.bit {
                b0 |= 0x08 | (bit & 7);
            }
            let [hi, lo] = f.byte.to_be_bytes();
            out.extend_from_slice(&[0x02, 0x06, 0, 0, b0, hi, lo, 0]);
        }
        out[start + 7] = (out.len() - start - 8) as u8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_format_layout() {
        let mut out = Vec::new();
        Sense::lba_out_of_range().encode(&mut out);
        assert_eq!(
            out,
            [0x70, 0, 5, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x21, 0, 0, 0, 0, 0]
        );
    }

    #[test]
    fn field_pointer_and_info() {
        let mut out = Vec::new();
        Sense::invalid_cdb_field(1, 3).encode(&mut out);
        assert_eq!(&out[12..18], &[0x24, 0, 0, 0xC0 | 0x08 | 3, 0, 1]);
        out.clear();
        Sense::miscompare(513).encode(&mut out);
        assert_eq!(out[0], 0xF0);
        assert_eq!(out[2], key::MISCOMPARE);
        assert_eq!(&out[3..7], &513u32.to_be_bytes());
        assert_eq!((out[12], out[13]), (0x1D, 0));
        out.clear();
        Sense::invalid_field_in_parameter_list()
            .at_param(4, None)
            .encode(&mut out);
        assert_eq!(&out[15..18], &[0x80, 0, 4]);
    }

    #[test]
    fn descriptor_format() {
        let mut out = Vec::new();
        Sense::miscompare(7).encode_descriptor(&mut out);
        assert_eq!(&out[..8], &[0x72, key::MISCOMPARE, 0x1D, 0, 0, 0, 0, 12]);
        assert_eq!(&out[8..12], &[0, 0x0A, 0x80, 0]);
        assert_eq!(&out[12..20], &7u64.to_be_bytes());
        assert_eq!(out.len(), 20);
    }
}
