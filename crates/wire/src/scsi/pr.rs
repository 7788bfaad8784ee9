//! Persistent reservations (SPC-4 persistent reservations, PERSISTENT RESERVE IN and OUT): one
//! [`Reservations`] per logical unit, shared by every session that reaches it. Registrations are
//! per I_T nexus ([`Nexus`]); one reservation at most, of one of the six types, held by one
//! nexus (or, for the "all registrants" types, by every registrant).
//!
//! Not supported: REGISTER AND MOVE, SPEC_I_PT, ALL_TG_PT, APTPL (REPORT CAPABILITIES says so,
//! and the service actions those bits belong to are refused with them set), and scopes other
//! than LU_SCOPE.

use super::sense::key;
use super::{get_u64, put_u16, put_u32, put_u64, Command, Sense};

/// PERSISTENT RESERVE IN service actions (SPC-4 PERSISTENT RESERVE IN).
pub mod sa_in {
    /// READ KEYS.
    pub const READ_KEYS: u8 = 0x00;
    /// READ RESERVATION.
    pub const READ_RESERVATION: u8 = 0x01;
    /// REPORT CAPABILITIES.
    pub const REPORT_CAPABILITIES: u8 = 0x02;
    /// READ FULL STATUS.
    pub const READ_FULL_STATUS: u8 = 0x03;
}

/// PERSISTENT RESERVE OUT service actions (SPC-4 PERSISTENT RESERVE OUT).
pub mod sa_out {
    /// REGISTER.
    pub const REGISTER: u8 = 0x00;
    /// RESERVE.
    pub const RESERVE: u8 = 0x01;
    /// RELEASE.
    pub const RELEASE: u8 = 0x02;
    /// CLEAR.
    pub const CLEAR: u8 = 0x03;
    /// PREEMPT.
    pub const PREEMPT: u8 = 0x04;
    /// PREEMPT AND ABORT.
    pub const PREEMPT_AND_ABORT: u8 = 0x05;
    /// REGISTER AND IGNORE EXISTING KEY.
    pub const REGISTER_AND_IGNORE: u8 = 0x06;
}

/// Persistent reservation types (SPC-4 PERSISTENT RESERVE OUT TYPE codes).
pub mod kind {
    /// Write Exclusive.
    pub const WRITE_EXCLUSIVE: u8 = 0x1;
    /// Exclusive Access.
    pub const EXCLUSIVE_ACCESS: u8 = 0x3;
    /// Write Exclusive – Registrants Only.
    pub const WRITE_EXCLUSIVE_RO: u8 = 0x5;
    /// Exclusive Access – Registrants Only.
    pub const EXCLUSIVE_ACCESS_RO: u8 = 0x6;
    /// Write Exclusive – All Registrants.
    pub const WRITE_EXCLUSIVE_AR: u8 = 0x7;
    /// Exclusive Access – All Registrants.
    pub const EXCLUSIVE_ACCESS_AR: u8 = 0x8;
}

/// Bytes of the PERSISTENT RESERVE OUT parameter list without SPEC_I_PT (SPC-4 PERSISTENT RESERVE
/// OUT parameter list).
pub const PARAM_LEN: usize = 24;
/// The PERSISTENT RESERVE OUT parameter list an initiator sends (SPC-4): RESERVATION KEY,
/// SERVICE ACTION RESERVATION KEY, no flags (what [`Reservations::reserve_out`] decodes).
pub fn out_parameters(res_key: u64, sa_key: u64) -> [u8; PARAM_LEN] {
    let mut p = [0u8; PARAM_LEN];
    p[0..8].copy_from_slice(&res_key.to_be_bytes());
    p[8..16].copy_from_slice(&sa_key.to_be_bytes());
    p
}

/// Registrations held at most per LU; one more is INSUFFICIENT REGISTRATION RESOURCES.
pub const MAX_REGISTRATIONS: usize = 256;

/// An I_T nexus: the initiator port and the target port it came through.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Nexus {
    /// The iSCSI initiator port name: initiator name, `,i,0x`, ISID in 12 hex digits
    /// (SPC-4 7.6.4.6, what READ FULL STATUS reports as its TransportID).
    pub initiator: String,
    /// RELATIVE TARGET PORT IDENTIFIER of the target port.
    pub target_port: u16,
}

/// Why a PERSISTENT RESERVE OUT failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// CHECK CONDITION with this sense.
    Sense(Sense),
    /// Status RESERVATION CONFLICT (18h), no sense.
    ReservationConflict,
}

impl From<Sense> for Outcome {
    fn from(s: Sense) -> Outcome {
        Outcome::Sense(s)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Registration {
    nexus: Nexus,
    key: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Reservation {
    /// The nexus that reserved (meaningless for the all-registrants types).
    holder: Nexus,
    kind: u8,
}

/// The persistent reservation state of one logical unit.
#[derive(Clone, Debug, Default)]
pub struct Reservations {
    generation: u32,
    registrations: Vec<Registration>,
    reservation: Option<Reservation>,
}

fn all_registrants(kind: u8) -> bool {
    matches!(kind, kind::WRITE_EXCLUSIVE_AR | kind::EXCLUSIVE_ACCESS_AR)
}

fn registrants_only(kind: u8) -> bool {
    matches!(kind, kind::WRITE_EXCLUSIVE_RO | kind::EXCLUSIVE_ACCESS_RO)
}

fn exclusive_access(kind: u8) -> bool {
    matches!(
        kind,
        kind::EXCLUSIVE_ACCESS | kind::EXCLUSIVE_ACCESS_RO | kind::EXCLUSIVE_ACCESS_AR
    )
}

fn valid_kind(kind: u8) -> bool {
    matches!(kind, 1 | 3 | 5..=8)
}

/// Does the command only read the medium, or otherwise act on it (SPC-4 and SBC-3 tables of
/// commands allowed in the presence of persistent reservations)? Those are refused to non-holders
/// under the Exclusive Access types.
fn touches_medium(cmd: &Command) -> bool {
    match cmd {
        Command::Read { .. }
        | Command::Verify { .. }
        | Command::PreFetch { .. }
        | Command::GetLbaStatus { .. }
        | Command::ReceiveCopyResults { .. } => true,
        // START STOP UNIT with START=1 and no power condition, and PREVENT ALLOW with
        // PREVENT=0, are allowed under every type (SBC-3 table 13).
        Command::StartStopUnit { start, loej } => !start || *loej,
        Command::PreventAllowMediumRemoval { prevent } => *prevent != 0,
        _ => false,
    }
}

/// What one I_T nexus may do under the reservation state it was worked out from
/// ([`Reservations::access`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Access {
    /// Everything: no reservation, or one that lets this nexus in.
    #[default]
    Full,
    /// No command that changes the medium (the Write Exclusive types, for a non-holder).
    NoWrites,
    /// Nothing that changes or reads the medium (the Exclusive Access types, for a non-holder).
    NoMedium,
}

impl Access {
    /// Does `cmd` end with RESERVATION CONFLICT?
    pub fn conflicts(self, cmd: &Command) -> bool {
        match self {
            Access::Full => false,
            Access::NoWrites => cmd.writes(),
            Access::NoMedium => cmd.writes() || touches_medium(cmd),
        }
    }
}

impl Reservations {
    /// No registrations, no reservation, PRGENERATION 0.
    pub fn new() -> Reservations {
        Reservations::default()
    }

    /// PRGENERATION (SPC-4 READ KEYS): bumped by every REGISTER, CLEAR, PREEMPT that changes
    /// something; not by RESERVE or RELEASE.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    fn key_of(&self, who: &Nexus) -> Option<u64> {
        self.registrations
            .iter()
            .find(|r| &r.nexus == who)
            .map(|r| r.key)
    }

    /// Is `who` a holder of the reservation (SPC-4 persistent reservation holder)? Every registrant
    /// is under the all-registrants types.
    fn holds(&self, who: &Nexus) -> bool {
        match &self.reservation {
            Some(r) if all_registrants(r.kind) => self.key_of(who).is_some(),
            Some(r) => &r.holder == who,
            None => false,
        }
    }

    /// Should `cmd` from `who` end with RESERVATION CONFLICT (the SPC-4/SBC-3 tables of commands
    /// allowed under persistent reservations)? Write Exclusive types refuse writes to everyone but
    /// the holder, Exclusive Access types refuse reads too; the Registrants Only and All
    /// Registrants types let every registrant in. PERSISTENT RESERVE IN/OUT, INQUIRY, REPORT LUNS,
    /// READ CAPACITY, TEST UNIT READY, REQUEST SENSE and the like never conflict.
    pub fn conflicts(&self, who: &Nexus, cmd: &Command) -> bool {
        self.access(who).conflicts(cmd)
    }

    /// What `who` may do while this state lasts: [`Reservations::conflicts`] worked out once per
    /// nexus, so a transport checks each command with a match on a copy instead of looking the
    /// nexus up among the registrations.
    pub fn access(&self, who: &Nexus) -> Access {
        let Some(r) = &self.reservation else {
            return Access::Full;
        };
        if self.holds(who) || (registrants_only(r.kind) && self.key_of(who).is_some()) {
            Access::Full
        } else if exclusive_access(r.kind) {
            Access::NoMedium
        } else {
            Access::NoWrites
        }
    }

    /// Is the logical unit reserved (by anyone)? Without a reservation nothing conflicts,
    /// whatever is registered.
    pub fn reserved(&self) -> bool {
        self.reservation.is_some()
    }

    /// The nexus went away (logout, connection loss). Registrations and the reservation are
    /// persistent: they survive the I_T nexus (SPC-4 persistent reservations), so nothing changes.
    pub fn nexus_lost(&mut self, who: &Nexus) {
        let _ = who;
    }

    /// PERSISTENT RESERVE IN (SPC-4): the parameter data of service action
    /// `sa`, truncated to `alloc_len` (the length fields stay the full ones).
    pub fn reserve_in(&self, sa: u8, alloc_len: u32) -> Result<Vec<u8>, Sense> {
        let mut b = Vec::new();
        match sa {
            sa_in::READ_KEYS => {
                b.extend_from_slice(&self.generation.to_be_bytes());
                b.extend_from_slice(&((self.registrations.len() * 8) as u32).to_be_bytes());
                for r in &self.registrations {
                    b.extend_from_slice(&r.key.to_be_bytes());
                }
            }
            sa_in::READ_RESERVATION => {
                b.extend_from_slice(&self.generation.to_be_bytes());
                match &self.reservation {
                    None => b.extend_from_slice(&[0; 4]),
                    Some(r) => {
                        b.extend_from_slice(&16u32.to_be_bytes());
                        // RESERVATION KEY: 0 for the all-registrants types (SPC-4 READ
                        // RESERVATION).
                        let k = if all_registrants(r.kind) {
                            0
                        } else {
                            self.key_of(&r.holder).unwrap_or(0)
                        };
                        b.extend_from_slice(&k.to_be_bytes());
                        b.extend_from_slice(&[0, 0, 0, 0, 0, r.kind & 0x0F, 0, 0]);
                    }
                }
            }
            sa_in::REPORT_CAPABILITIES => {
                // SPC-4 REPORT CAPABILITIES: LENGTH 8; CRH=0, SIP_C=0, ATP_C=0, PTPL_C=0; TMV=1
                // with ALLOW COMMANDS 000b; every type in the mask.
                b.extend_from_slice(&[0, 8, 0x00, 0x80, 0xEA, 0x01, 0, 0]);
            }
            sa_in::READ_FULL_STATUS => {
                b.extend_from_slice(&self.generation.to_be_bytes());
                b.extend_from_slice(&[0; 4]);
                for r in &self.registrations {
                    let tid = transport_id(&r.nexus.initiator);
                    let mut d = [0u8; 24];
                    put_u64(&mut d[0..], r.key);
                    if self.holds(&r.nexus) {
                        d[12] = 0x01; // R_HOLDER
                        d[13] = self.reservation.as_ref().map_or(0, |v| v.kind & 0x0F);
                    }
                    put_u16(&mut d[18..], r.nexus.target_port);
                    put_u32(&mut d[20..], tid.len() as u32);
                    b.extend_from_slice(&d);
                    b.extend_from_slice(&tid);
                }
                let len = (b.len() - 8) as u32;
                put_u32(&mut b[4..], len);
            }
            _ => return Err(Sense::invalid_cdb_field(1, 4)),
        }
        b.truncate(alloc_len as usize);
        Ok(b)
    }

    /// PERSISTENT RESERVE OUT (SPC-4 PERSISTENT RESERVE OUT; the semantics are in the persistent
    /// reservations clause: registering, reserving, releasing, clearing, preempting) from `who`
    /// with service action `sa`, SCOPE `scope`, TYPE `kind` and the Data-Out `params`.
    pub fn reserve_out(
        &mut self,
        who: &Nexus,
        sa: u8,
        scope: u8,
        kind: u8,
        params: &[u8],
    ) -> Result<(), Outcome> {
        if sa > sa_out::REGISTER_AND_IGNORE {
            return Err(Sense::invalid_cdb_field(1, 4).into());
        }
        // SPC-4 PERSISTENT RESERVE OUT parameter list: 24 bytes exactly without SPEC_I_PT.
        if params.len() != PARAM_LEN {
            return Err(Sense::parameter_list_length_error().into());
        }
        let res_key = get_u64(&params[0..]);
        let sa_key = get_u64(&params[8..]);
        // SPEC_I_PT (bit 3) belongs to REGISTER alone and is refused with any other service
        // action; ALL_TG_PT (bit 2) and APTPL (bit 0) belong to REGISTER and REGISTER AND IGNORE
        // EXISTING KEY and the others ignore them (SPC-4 PERSISTENT RESERVE OUT parameter list):
        // an initiator may leave APTPL set on every command after registering with it. None of
        // the three is supported (SIP_C, ATP_C, PTPL_C = 0 in REPORT CAPABILITIES), so where
        // they count, set to one, they are INVALID FIELD IN PARAMETER LIST.
        let counted = match sa {
            sa_out::REGISTER | sa_out::REGISTER_AND_IGNORE => 0x0D,
            _ => 0x08,
        };
        let flags = params[20] & counted;
        if flags != 0 {
            let bit = if flags & 0x08 != 0 {
                3
            } else if flags & 0x04 != 0 {
                2
            } else {
                0
            };
            return Err(Sense::invalid_field_in_parameter_list()
                .at_param(20, Some(bit))
                .into());
        }
        let mine = self.key_of(who);
        match sa {
            sa_out::REGISTER | sa_out::REGISTER_AND_IGNORE => {
                if sa == sa_out::REGISTER && res_key != mine.unwrap_or(0) {
                    return Err(Outcome::ReservationConflict);
                }
                match (mine, sa_key) {
                    (None, 0) => {}
                    (None, k) => {
                        if self.registrations.len() >= MAX_REGISTRATIONS {
                            // INSUFFICIENT REGISTRATION RESOURCES (SPC-4 registering).
                            return Err(Sense::new(key::ILLEGAL_REQUEST, 0x55, 0x04).into());
                        }
                        self.registrations.push(Registration {
                            nexus: who.clone(),
                            key: k,
                        });
                        self.generation = self.generation.wrapping_add(1);
                    }
                    (Some(_), 0) => {
                        self.unregister(who);
                        self.generation = self.generation.wrapping_add(1);
                    }
                    (Some(_), k) => {
                        if let Some(r) = self.registrations.iter_mut().find(|r| &r.nexus == who) {
                            r.key = k;
                        }
                        self.generation = self.generation.wrapping_add(1);
                    }
                }
                Ok(())
            }
            sa_out::RESERVE => {
                self.check_scope_kind(scope, kind)?;
                if mine != Some(res_key) {
                    return Err(Outcome::ReservationConflict);
                }
                match &self.reservation {
                    None => {
                        self.reservation = Some(Reservation {
                            holder: who.clone(),
                            kind,
                        });
                        Ok(())
                    }
                    // SPC-4 reserving: the holder reserving again with the same type is a no-op;
                    // anything else conflicts.
                    Some(r) if self.holds(who) && r.kind == kind => Ok(()),
                    Some(_) => Err(Outcome::ReservationConflict),
                }
            }
            sa_out::RELEASE => {
                if mine != Some(res_key) {
                    return Err(Outcome::ReservationConflict);
                }
                let Some(r) = &self.reservation else {
                    return Ok(());
                };
                if !self.holds(who) {
                    return Ok(()); // SPC-4 releasing: not the holder, nothing happens
                }
                if scope != 0 || r.kind != kind {
                    // INVALID RELEASE OF PERSISTENT RESERVATION.
                    return Err(Sense::new(key::ILLEGAL_REQUEST, 0x26, 0x04).into());
                }
                self.reservation = None;
                Ok(())
            }
            sa_out::CLEAR => {
                if mine != Some(res_key) {
                    return Err(Outcome::ReservationConflict);
                }
                self.registrations.clear();
                self.reservation = None;
                self.generation = self.generation.wrapping_add(1);
                Ok(())
            }
            _ => {
                // PREEMPT and PREEMPT AND ABORT (SPC-4 preempting); aborting the preempted
                // nexuses' tasks is the transport's part.
                if mine != Some(res_key) {
                    return Err(Outcome::ReservationConflict);
                }
                self.check_scope_kind(scope, kind)?;
                self.preempt(who, sa_key, kind)
            }
        }
    }

    fn check_scope_kind(&self, scope: u8, kind: u8) -> Result<(), Outcome> {
        if scope != 0 {
            return Err(Sense::invalid_cdb_field(2, 7).into());
        }
        if !valid_kind(kind) {
            return Err(Sense::invalid_cdb_field(2, 3).into());
        }
        Ok(())
    }

    /// Removes `who`'s registration; the reservation goes with it when `who` held it alone,
    /// or when it was the last registrant of an all-registrants reservation (SPC-4 releasing).
    fn unregister(&mut self, who: &Nexus) {
        self.registrations.retain(|r| &r.nexus != who);
        if let Some(r) = &self.reservation {
            let gone = if all_registrants(r.kind) {
                self.registrations.is_empty()
            } else {
                &r.holder == who
            };
            if gone {
                self.reservation = None;
            }
        }
    }

    fn remove_key(&mut self, who: &Nexus, k: u64) -> bool {
        let before = self.registrations.len();
        self.registrations.retain(|r| r.key != k || &r.nexus == who);
        before != self.registrations.len()
    }

    fn preempt(&mut self, who: &Nexus, sa_key: u64, kind: u8) -> Result<(), Outcome> {
        let zero_key = || {
            Sense::invalid_field_in_parameter_list()
                .at_param(8, Some(7))
                .into()
        };
        match self.reservation.clone() {
            Some(r) if all_registrants(r.kind) => {
                if sa_key == 0 {
                    // Everyone else goes; `who` holds a new reservation of `kind`.
                    self.registrations.retain(|x| &x.nexus == who);
                    self.reservation = Some(Reservation {
                        holder: who.clone(),
                        kind,
                    });
                } else if !self.remove_key(who, sa_key) {
                    return Err(Outcome::ReservationConflict);
                }
            }
            Some(r) if self.key_of(&r.holder) == Some(sa_key) => {
                // Preempting the holder: its registrations (and all with that key) go, and the
                // reservation passes to `who` with the new type.
                self.remove_key(who, sa_key);
                self.reservation = Some(Reservation {
                    holder: who.clone(),
                    kind,
                });
            }
            _ => {
                if sa_key == 0 {
                    return Err(zero_key());
                }
                if !self.remove_key(who, sa_key) {
                    return Err(Outcome::ReservationConflict);
                }
            }
        }
        self.generation = self.generation.wrapping_add(1);
        Ok(())
    }
}

/// The iSCSI TransportID of an initiator port (SPC-4 7.6.4.6): FORMAT CODE 01b (name with ISID)
/// when the name carries `,i,0x`, else 00b; PROTOCOL IDENTIFIER 5h; the name NUL-terminated and
/// padded to a multiple of 4, at least 20 bytes in all. Names are cut at 223 bytes (RFC 7143
/// 4.2.7.1 bounds iSCSI names to 223).
fn transport_id(initiator: &str) -> Vec<u8> {
    let name = &initiator.as_bytes()[..initiator.len().min(223 + 19)];
    let format = if initiator.contains(",i,0x") {
        0x40
    } else {
        0x00
    };
    let body = (name.len() + 1).div_ceil(4) * 4;
    let body = body.max(16);
    let mut b = vec![0u8; 4 + body];
    b[0] = format | 0x05;
    put_u16(&mut b[2..], body as u16);
    b[4..4 + name.len()].copy_from_slice(name);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nexus(n: u8) -> Nexus {
        Nexus {
            initiator: format!("iqn.2026-11.test:{n},i,0x00023d000001"),
            target_port: 1,
        }
    }

    fn read() -> Command {
        Command::Read {
            lba: 0,
            blocks: 1,
            fua: false,
        }
    }
    fn write() -> Command {
        Command::Write {
            lba: 0,
            blocks: 1,
            fua: false,
        }
    }

    /// Registers `who` with `key` (REGISTER AND IGNORE EXISTING KEY).
    fn register(pr: &mut Reservations, who: &Nexus, key: u64) {
        pr.reserve_out(
            who,
            sa_out::REGISTER_AND_IGNORE,
            0,
            0,
            &out_parameters(0, key),
        )
        .unwrap();
    }

    fn keys(pr: &Reservations) -> Vec<u64> {
        let b = pr.reserve_in(sa_in::READ_KEYS, 4096).unwrap();
        b[8..].chunks(8).map(get_u64).collect()
    }

    #[test]
    fn register_unregister_and_generation() {
        let mut pr = Reservations::new();
        let (a, b) = (nexus(1), nexus(2));
        pr.reserve_out(&a, sa_out::REGISTER, 0, 0, &out_parameters(0, 0xAA))
            .unwrap();
        assert_eq!(pr.generation(), 1);
        // REGISTER with the wrong key conflicts; REGISTER AND IGNORE does not.
        assert_eq!(
            pr.reserve_out(&a, sa_out::REGISTER, 0, 0, &out_parameters(0x11, 0xAB)),
            Err(Outcome::ReservationConflict)
        );
        register(&mut pr, &a, 0xAB);
        register(&mut pr, &b, 0xBB);
        assert_eq!(keys(&pr), [0xAB, 0xBB]);
        assert_eq!(pr.generation(), 3);
        // Truncated READ KEYS keeps ADDITIONAL LENGTH.
        assert_eq!(
            pr.reserve_in(sa_in::READ_KEYS, 8).unwrap(),
            [0, 0, 0, 3, 0, 0, 0, 16]
        );
        pr.reserve_out(&b, sa_out::REGISTER, 0, 0, &out_parameters(0xBB, 0))
            .unwrap();
        assert_eq!(keys(&pr), [0xAB]);
        // Wrong parameter length, APTPL, unknown SA.
        assert_eq!(
            pr.reserve_out(&a, sa_out::REGISTER, 0, 0, &[0; 23]),
            Err(Outcome::Sense(Sense::parameter_list_length_error()))
        );
        let mut p = out_parameters(0xAB, 1);
        p[20] = 1;
        let e = pr.reserve_out(&a, sa_out::REGISTER, 0, 0, &p);
        assert!(matches!(e, Err(Outcome::Sense(s)) if s.asc == 0x26));
        assert!(pr.reserve_in(4, 100).is_err());
    }

    /// APTPL and ALL_TG_PT count for REGISTER and REGISTER AND IGNORE EXISTING KEY only (refused
    /// there, being unsupported) and are ignored by the other service actions; SPEC_I_PT is
    /// refused with every service action (SPC-4 PERSISTENT RESERVE OUT parameter list).
    #[test]
    fn parameter_list_flags_count_only_for_the_actions_they_belong_to() {
        let mut pr = Reservations::new();
        let a = nexus(1);
        let with = |res_key: u64, sa_key: u64, flags: u8| {
            let mut p = out_parameters(res_key, sa_key);
            p[20] = flags;
            p
        };
        let refused_at = |bit: u8| {
            Err(Outcome::Sense(
                Sense::invalid_field_in_parameter_list().at_param(20, Some(bit)),
            ))
        };
        for sa in [sa_out::REGISTER, sa_out::REGISTER_AND_IGNORE] {
            assert_eq!(
                pr.reserve_out(&a, sa, 0, 0, &with(0, 7, 0x01)),
                refused_at(0)
            );
            assert_eq!(
                pr.reserve_out(&a, sa, 0, 0, &with(0, 7, 0x04)),
                refused_at(2)
            );
            assert_eq!(
                pr.reserve_out(&a, sa, 0, 0, &with(0, 7, 0x08)),
                refused_at(3)
            );
        }
        assert!(keys(&pr).is_empty(), "nothing registered");
        register(&mut pr, &a, 7);
        // APTPL and ALL_TG_PT left set by an initiator that registers with them: ignored.
        let we = kind::WRITE_EXCLUSIVE;
        pr.reserve_out(&a, sa_out::RESERVE, 0, we, &with(7, 0, 0x05))
            .unwrap();
        assert!(pr.conflicts(&nexus(2), &write()));
        pr.reserve_out(&a, sa_out::RELEASE, 0, we, &with(7, 0, 0x05))
            .unwrap();
        assert!(!pr.reserved());
        for sa in [
            sa_out::RESERVE,
            sa_out::RELEASE,
            sa_out::PREEMPT,
            sa_out::CLEAR,
        ] {
            assert_eq!(
                pr.reserve_out(&a, sa, 0, we, &with(7, 7, 0x08)),
                refused_at(3),
                "SPEC_I_PT with service action {sa}"
            );
        }
        pr.reserve_out(&a, sa_out::CLEAR, 0, 0, &with(7, 0, 0x05))
            .unwrap();
        assert!(keys(&pr).is_empty(), "CLEAR ran");
    }

    #[test]
    fn reserve_release_clear() {
        let mut pr = Reservations::new();
        let (a, b) = (nexus(1), nexus(2));
        pr.reserve_out(&a, sa_out::REGISTER, 0, 0, &out_parameters(0, 1))
            .unwrap();
        // Unregistered nexus cannot reserve.
        assert_eq!(
            pr.reserve_out(
                &b,
                sa_out::RESERVE,
                0,
                kind::EXCLUSIVE_ACCESS,
                &out_parameters(0, 0)
            ),
            Err(Outcome::ReservationConflict)
        );
        let gen = pr.generation();
        pr.reserve_out(
            &a,
            sa_out::RESERVE,
            0,
            kind::EXCLUSIVE_ACCESS,
            &out_parameters(1, 0),
        )
        .unwrap();
        assert_eq!(pr.generation(), gen);
        let r = pr.reserve_in(sa_in::READ_RESERVATION, 100).unwrap();
        assert_eq!(r.len(), 24);
        assert_eq!(&r[4..16], &[0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(r[21], kind::EXCLUSIVE_ACCESS);
        // Same type again: fine; another type: conflict; bad type: invalid field.
        pr.reserve_out(
            &a,
            sa_out::RESERVE,
            0,
            kind::EXCLUSIVE_ACCESS,
            &out_parameters(1, 0),
        )
        .unwrap();
        assert_eq!(
            pr.reserve_out(
                &a,
                sa_out::RESERVE,
                0,
                kind::WRITE_EXCLUSIVE,
                &out_parameters(1, 0)
            ),
            Err(Outcome::ReservationConflict)
        );
        assert!(matches!(
            pr.reserve_out(&a, sa_out::RESERVE, 0, 2, &out_parameters(1, 0)),
            Err(Outcome::Sense(s)) if s.asc == 0x24
        ));
        // Release with the wrong type is INVALID RELEASE.
        assert!(matches!(
            pr.reserve_out(&a, sa_out::RELEASE, 0, kind::WRITE_EXCLUSIVE, &out_parameters(1, 0)),
            Err(Outcome::Sense(s)) if (s.asc, s.ascq) == (0x26, 0x04)
        ));
        pr.reserve_out(
            &a,
            sa_out::RELEASE,
            0,
            kind::EXCLUSIVE_ACCESS,
            &out_parameters(1, 0),
        )
        .unwrap();
        assert_eq!(
            pr.reserve_in(sa_in::READ_RESERVATION, 100).unwrap()[4..8],
            [0, 0, 0, 0]
        );
        pr.reserve_out(
            &a,
            sa_out::RESERVE,
            0,
            kind::EXCLUSIVE_ACCESS,
            &out_parameters(1, 0),
        )
        .unwrap();
        pr.reserve_out(&a, sa_out::CLEAR, 0, 0, &out_parameters(1, 0))
            .unwrap();
        assert_eq!(pr.generation(), gen + 1);
        assert!(keys(&pr).is_empty());
        assert!(!pr.conflicts(&b, &write()));
    }

    /// libiscsi's ProutReserve.Access*: (registered other can read, write; unregistered other
    /// can read, write) per type; the holder can always do both.
    #[test]
    fn access_per_type() {
        let table = [
            (kind::EXCLUSIVE_ACCESS, [false, false, false, false]),
            (kind::WRITE_EXCLUSIVE, [true, false, true, false]),
            (kind::EXCLUSIVE_ACCESS_RO, [true, true, false, false]),
            (kind::WRITE_EXCLUSIVE_RO, [true, true, true, false]),
            (kind::EXCLUSIVE_ACCESS_AR, [true, true, false, false]),
            (kind::WRITE_EXCLUSIVE_AR, [true, true, true, false]),
        ];
        for (k, [rr, rw, ur, uw]) in table {
            let mut pr = Reservations::new();
            let (a, b) = (nexus(1), nexus(2));
            register(&mut pr, &a, 1);
            register(&mut pr, &b, 2);
            pr.reserve_out(&a, sa_out::RESERVE, 0, k, &out_parameters(1, 0))
                .unwrap();
            assert!(
                !pr.conflicts(&a, &read()) && !pr.conflicts(&a, &write()),
                "{k}"
            );
            assert_eq!(!pr.conflicts(&b, &read()), rr, "{k} registered read");
            assert_eq!(!pr.conflicts(&b, &write()), rw, "{k} registered write");
            pr.reserve_out(&b, sa_out::REGISTER, 0, 0, &out_parameters(2, 0))
                .unwrap();
            assert_eq!(!pr.conflicts(&b, &read()), ur, "{k} unregistered read");
            assert_eq!(!pr.conflicts(&b, &write()), uw, "{k} unregistered write");
            assert!(!pr.conflicts(&b, &Command::TestUnitReady));
            let r = pr.reserve_in(sa_in::READ_RESERVATION, 100).unwrap();
            let want_key = if all_registrants(k) { 0 } else { 1 };
            assert_eq!(get_u64(&r[8..]), want_key, "{k}");
            pr.reserve_out(&a, sa_out::RELEASE, 0, k, &out_parameters(1, 0))
                .unwrap();
            assert!(!pr.conflicts(&b, &write()));
        }
    }

    /// libiscsi's ProutReserve.Ownership*: when the holder unregisters, the reservation goes,
    /// except for the all-registrants types while others remain registered.
    /// `access` is `conflicts` worked out once: the same answer for every command, type and
    /// kind of nexus (holder, registered, not registered), and Full without a reservation.
    #[test]
    fn access_agrees_with_conflicts() {
        let cmds = [
            read(),
            write(),
            Command::TestUnitReady,
            Command::SynchronizeCache { lba: 0, blocks: 0 },
            Command::StartStopUnit {
                start: false,
                loej: false,
            },
        ];
        let (a, b, c) = (nexus(1), nexus(2), nexus(3));
        let mut pr = Reservations::new();
        assert!(!pr.reserved());
        assert_eq!(pr.access(&c), Access::Full);
        register(&mut pr, &a, 1);
        register(&mut pr, &b, 2);
        for k in [1, 3, 5, 6, 7, 8] {
            pr.reserve_out(&a, sa_out::RESERVE, 0, k, &out_parameters(1, 0))
                .unwrap();
            assert!(pr.reserved());
            for who in [&a, &b, &c] {
                let access = pr.access(who);
                for cmd in &cmds {
                    assert_eq!(access.conflicts(cmd), pr.conflicts(who, cmd), "{k} {cmd:?}");
                }
            }
            assert_eq!(pr.access(&a), Access::Full);
            pr.reserve_out(&a, sa_out::RELEASE, 0, k, &out_parameters(1, 0))
                .unwrap();
        }
        assert_eq!(pr.access(&c), Access::Full);
    }

    #[test]
    fn ownership_on_unregister() {
        for k in [1, 3, 5, 6, 7, 8] {
            let mut pr = Reservations::new();
            let (a, b) = (nexus(1), nexus(2));
            register(&mut pr, &a, 1);
            register(&mut pr, &b, 2);
            pr.reserve_out(&a, sa_out::RESERVE, 0, k, &out_parameters(1, 0))
                .unwrap();
            pr.reserve_out(&a, sa_out::REGISTER, 0, 0, &out_parameters(1, 0))
                .unwrap();
            let still = pr.reserve_in(sa_in::READ_RESERVATION, 100).unwrap()[7] != 0;
            assert_eq!(still, all_registrants(k), "{k}");
        }
    }

    #[test]
    fn preempt_removes_registration() {
        let mut pr = Reservations::new();
        let (a, b) = (nexus(1), nexus(2));
        register(&mut pr, &a, 0x1);
        register(&mut pr, &b, 0x2);
        let gen = pr.generation();
        pr.reserve_out(
            &b,
            sa_out::PREEMPT,
            0,
            kind::EXCLUSIVE_ACCESS,
            &out_parameters(2, 1),
        )
        .unwrap();
        assert_eq!(keys(&pr), [2]);
        assert_eq!(pr.generation(), gen + 1);
        // Preempting a key nobody has conflicts; key 0 without a reservation is invalid.
        assert_eq!(
            pr.reserve_out(
                &b,
                sa_out::PREEMPT,
                0,
                kind::EXCLUSIVE_ACCESS,
                &out_parameters(2, 9)
            ),
            Err(Outcome::ReservationConflict)
        );
        assert!(matches!(
            pr.reserve_out(
                &b,
                sa_out::PREEMPT,
                0,
                kind::EXCLUSIVE_ACCESS,
                &out_parameters(2, 0)
            ),
            Err(Outcome::Sense(_))
        ));
        // Preempting the holder moves the reservation.
        register(&mut pr, &a, 0x1);
        pr.reserve_out(
            &a,
            sa_out::RESERVE,
            0,
            kind::WRITE_EXCLUSIVE,
            &out_parameters(1, 0),
        )
        .unwrap();
        pr.reserve_out(
            &b,
            sa_out::PREEMPT_AND_ABORT,
            0,
            kind::EXCLUSIVE_ACCESS,
            &out_parameters(2, 1),
        )
        .unwrap();
        assert!(pr.conflicts(&a, &read()));
        assert!(!pr.conflicts(&b, &write()));
        assert_eq!(keys(&pr), [2]);
    }

    #[test]
    fn capabilities_and_full_status() {
        let mut pr = Reservations::new();
        assert_eq!(
            pr.reserve_in(sa_in::REPORT_CAPABILITIES, 100).unwrap(),
            [0, 8, 0, 0x80, 0xEA, 0x01, 0, 0]
        );
        let a = nexus(1);
        pr.reserve_out(&a, sa_out::REGISTER, 0, 0, &out_parameters(0, 7))
            .unwrap();
        pr.reserve_out(
            &a,
            sa_out::RESERVE,
            0,
            kind::WRITE_EXCLUSIVE,
            &out_parameters(7, 0),
        )
        .unwrap();
        let b = pr.reserve_in(sa_in::READ_FULL_STATUS, 4096).unwrap();
        let add = u32::from_be_bytes([b[4], b[5], b[6], b[7]]) as usize;
        assert_eq!(add, b.len() - 8);
        assert_eq!(get_u64(&b[8..]), 7);
        assert_eq!((b[8 + 12], b[8 + 13]), (1, kind::WRITE_EXCLUSIVE));
        assert_eq!(&b[8 + 18..8 + 20], &[0, 1]);
        let tid = &b[32..];
        assert_eq!(tid[0], 0x45);
        assert_eq!(tid.len() % 4, 0);
        assert!(tid[4..].starts_with(a.initiator.as_bytes()));
        assert_eq!(tid[4 + a.initiator.len()], 0);
    }
}
