//! Configured iSCSI targets (`serve --iscsi-target`, the `iscsi_target_*` calls): an IQN with
//! several LUNs (exports, by name) and the initiators it admits. Every export is also a target
//! of its own (`iqn.2026-11.io.blkwire:NAME`, LUN 0) which these do not change.
//!
//! An initiator logs in to a configured target when the target admits it (any initiator, or
//! one on its list: the name CHAP proved with a key store, the InitiatorName without one,
//! RFC 7143 §13.6 / §12.1.3) and sees the LUNs whose exports' own rules let it open them
//! (LUN masking: the others are absent for it). Each LUN is its own blkwire session, as each
//! namespace of an NVMe/TCP subsystem is.

use blkwire_wire::iscsi::BLKWIRE_IQN_PREFIX;

/// LUNs one target may have: each is a session of every login (and a target of the
/// connection, whose index is a `u8`).
pub const MAX_LUNS: usize = 32;
/// Highest LUN number: SAM-5 flat space addressing (14 bits), what REPORT LUNS encodes.
pub const MAX_LUN: u64 = 16383;
/// Longest iSCSI name (RFC 7143 §4.2.7.1: 223 bytes).
const MAX_NAME: usize = 223;

/// A configured target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfiguredTarget {
    /// Its IQN.
    pub iqn: String,
    /// (LUN, export name), LUN ascending.
    pub luns: Vec<(u64, String)>,
    /// The initiator names admitted (when not `any_initiator`).
    pub initiators: Vec<String>,
    /// Any initiator is admitted (the exports' rules and the key store still apply).
    pub any_initiator: bool,
}

impl ConfiguredTarget {
    /// Whether the initiator named `who` (CHAP-proven, else its InitiatorName) may log in.
    pub fn admits(&self, who: &str) -> bool {
        self.any_initiator || self.initiators.iter().any(|i| i == who)
    }

    /// What `iscsi_target_list` and `save_config` show of it (without sizes and sessions).
    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "iqn": self.iqn,
            "configured": true,
            "any_initiator": self.any_initiator,
            "initiators": self.initiators,
            "luns": self.luns.iter()
                .map(|(l, e)| serde_json::json!({ "lun": l, "export": e }))
                .collect::<Vec<_>>(),
        })
    }
}

/// Checks an iSCSI name (RFC 7143 §4.2.7: `iqn.`, `eui.` or `naa.` names, at most 223 bytes;
/// RFC 3722 normalises them to lower case, so only lower-case letters, digits, '.', '-' and
/// ':' are taken here).
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    let typed = ["iqn.", "eui.", "naa."]
        .iter()
        .any(|p| name.len() > p.len() && name.starts_with(p));
    let chars = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b".-:".contains(&b));
    if !typed || !chars || name.len() > MAX_NAME {
        return Err(format!(
            "bad {what} '{}': expected an iSCSI name such as iqn.2026-11.com.example:name \
             (lower case, digits, '.', '-', ':'; at most {MAX_NAME} bytes)",
            name.escape_debug()
        ));
    }
    Ok(())
}

/// A target as `serve --iscsi-target` writes it:
/// `IQN=EXPORT[@LUN][,EXPORT[@LUN]...][;allow=INITIATOR[+INITIATOR...]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetSpec {
    /// Its IQN.
    pub iqn: String,
    /// Exports in order, each with the LUN it asked for (None: the lowest free one).
    pub luns: Vec<(String, Option<u64>)>,
    /// The initiators admitted (None: any).
    pub initiators: Option<Vec<String>>,
}

/// What `--iscsi-target` looks like, for its errors.
pub const TARGET_USAGE: &str =
    "IQN=EXPORT[@LUN][,EXPORT[@LUN]...][;allow=INITIATOR_IQN[+INITIATOR_IQN...]]";

/// Parses a LUN number (0 to [`MAX_LUN`]).
pub fn parse_lun(v: &str) -> Result<u64, String> {
    v.parse::<u64>()
        .ok()
        .filter(|&l| l <= MAX_LUN)
        .ok_or_else(|| format!("bad LUN '{}': LUNs are 0 to {MAX_LUN}", v.escape_debug()))
}

impl TargetSpec {
    /// Parses `--iscsi-target`; `Err` is a one-line reason naming the flag.
    pub fn parse(text: &str) -> Result<TargetSpec, String> {
        let bad = |why: String| {
            format!(
                "--iscsi-target '{}': {why} (expected {TARGET_USAGE})",
                text.escape_debug()
            )
        };
        let mut parts = text.split(';');
        let head = parts.next().unwrap_or_default();
        let Some((iqn, exports)) = head.split_once('=') else {
            return Err(bad("no '=' after the IQN".into()));
        };
        check_name("target IQN", iqn).map_err(bad)?;
        if iqn.starts_with(BLKWIRE_IQN_PREFIX) {
            return Err(bad(format!(
                "names under {BLKWIRE_IQN_PREFIX} are the exports' own targets: choose another"
            )));
        }
        let mut luns: Vec<(String, Option<u64>)> = Vec::new();
        for e in exports.split(',') {
            let (name, lun) = match e.rsplit_once('@') {
                Some((n, l)) => (n, Some(parse_lun(l).map_err(bad)?)),
                None => (e, None),
            };
            if name.is_empty() {
                return Err(bad("an empty export name".into()));
            }
            if luns.iter().any(|(n, _)| n == name) {
                return Err(bad(format!(
                    "export '{}' is listed twice",
                    name.escape_debug()
                )));
            }
            if lun.is_some() && luns.iter().any(|(_, l)| *l == lun) {
                return Err(bad(format!("LUN {} is given twice", lun.unwrap_or(0))));
            }
            luns.push((name.to_string(), lun));
        }
        if luns.len() > MAX_LUNS {
            return Err(bad(format!("more than {MAX_LUNS} LUNs")));
        }
        let mut spec = TargetSpec {
            iqn: iqn.to_string(),
            luns,
            initiators: None,
        };
        for opt in parts {
            match opt.split_once('=') {
                Some(("allow", v)) => {
                    let list: Vec<String> = v.split('+').map(str::to_string).collect();
                    for i in &list {
                        check_name("initiator IQN", i).map_err(bad)?;
                    }
                    spec.initiators = Some(list);
                }
                _ => {
                    return Err(bad(format!(
                        "unknown option '{}' (the one option is allow=)",
                        opt.escape_debug()
                    )))
                }
            }
        }
        Ok(spec)
    }

    /// The calls that build it (after its exports are added). LUNs without a number get the
    /// lowest free one when added, in order, after those given a number.
    pub fn calls(&self) -> Vec<crate::control::Call> {
        use crate::control::Call;
        let mut create = serde_json::json!({ "iqn": self.iqn });
        if let Some(list) = &self.initiators {
            create["allow"] = list.clone().into();
        }
        let mut calls = vec![Call::new("iscsi_target_create", create)];
        let numbered = self.luns.iter().filter(|(_, l)| l.is_some());
        let rest = self.luns.iter().filter(|(_, l)| l.is_none());
        for (export, lun) in numbered.chain(rest) {
            let mut p = serde_json::json!({ "iqn": self.iqn, "export": export });
            if let Some(l) = lun {
                p["lun"] = (*l).into();
            }
            calls.push(Call::new("iscsi_target_add_lun", p));
        }
        calls
    }
}

/// The configured targets, kept in [`super::Portals`]' table.
#[derive(Default)]
pub(super) struct Targets {
    pub(super) list: Vec<ConfiguredTarget>,
}

impl Targets {
    pub(super) fn create(
        &mut self,
        iqn: &str,
        initiators: Option<Vec<String>>,
        taken: bool,
    ) -> Result<ConfiguredTarget, String> {
        check_name("target IQN", iqn)?;
        if taken || iqn.starts_with(BLKWIRE_IQN_PREFIX) {
            return Err(format!(
                "target IQN '{}' is taken (names under {BLKWIRE_IQN_PREFIX} are the exports' own \
                 targets): choose another",
                iqn.escape_debug()
            ));
        }
        if self.list.iter().any(|t| t.iqn == iqn) {
            return Err(format!("target '{}' exists already", iqn.escape_debug()));
        }
        for i in initiators.iter().flatten() {
            check_name("initiator IQN", i)?;
        }
        let mut list = initiators.clone().unwrap_or_default();
        list.dedup();
        let t = ConfiguredTarget {
            iqn: iqn.to_string(),
            luns: Vec::new(),
            any_initiator: initiators.is_none(),
            initiators: list,
        };
        self.list.push(t.clone());
        Ok(t)
    }

    pub(super) fn get_mut(&mut self, iqn: &str) -> Result<&mut ConfiguredTarget, String> {
        self.list.iter_mut().find(|t| t.iqn == iqn).ok_or_else(|| {
            format!(
                "no iSCSI target '{}' (`blkwire iscsi-target ls` or iscsi_target_list shows them)",
                iqn.escape_debug()
            )
        })
    }

    pub(super) fn delete(&mut self, iqn: &str) -> Result<(), String> {
        self.get_mut(iqn)?;
        self.list.retain(|t| t.iqn != iqn);
        Ok(())
    }

    pub(super) fn add_lun(
        &mut self,
        iqn: &str,
        export: &str,
        lun: Option<u64>,
    ) -> Result<u64, String> {
        let t = self.get_mut(iqn)?;
        if t.luns.len() >= MAX_LUNS {
            return Err(format!(
                "target '{}' has {MAX_LUNS} LUNs, the most there may be",
                iqn.escape_debug()
            ));
        }
        if t.luns.iter().any(|(_, e)| e == export) {
            return Err(format!(
                "export '{}' is a LUN of target '{}' already",
                export.escape_debug(),
                iqn.escape_debug()
            ));
        }
        let l = match lun {
            Some(l) if l > MAX_LUN => return Err(format!("bad LUN {l}: LUNs are 0 to {MAX_LUN}")),
            Some(l) if t.luns.iter().any(|(n, _)| *n == l) => {
                return Err(format!(
                    "LUN {l} of target '{}' is in use: remove it first or choose another",
                    iqn.escape_debug()
                ))
            }
            Some(l) => l,
            None => (0..=MAX_LUN)
                .find(|l| t.luns.iter().all(|(n, _)| n != l))
                .expect("fewer LUNs than numbers"),
        };
        t.luns.push((l, export.to_string()));
        t.luns.sort_by_key(|(n, _)| *n);
        Ok(l)
    }

    pub(super) fn remove_lun(&mut self, iqn: &str, lun: u64) -> Result<String, String> {
        let t = self.get_mut(iqn)?;
        let i = t
            .luns
            .iter()
            .position(|(n, _)| *n == lun)
            .ok_or_else(|| format!("target '{}' has no LUN {lun}", iqn.escape_debug()))?;
        Ok(t.luns.remove(i).1)
    }

    /// Admits `who`; a target that admitted any initiator admits only its list from then on.
    pub(super) fn add_initiator(&mut self, iqn: &str, who: &str) -> Result<(), String> {
        check_name("initiator IQN", who)?;
        let t = self.get_mut(iqn)?;
        t.any_initiator = false;
        if !t.initiators.iter().any(|i| i == who) {
            t.initiators.push(who.to_string());
        }
        Ok(())
    }

    pub(super) fn remove_initiator(&mut self, iqn: &str, who: &str) -> Result<(), String> {
        let t = self.get_mut(iqn)?;
        let before = t.initiators.len();
        t.initiators.retain(|i| i != who);
        if t.initiators.len() == before {
            return Err(format!(
                "initiator '{}' is not on target '{}''s list",
                who.escape_debug(),
                iqn.escape_debug()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_spec_parses_luns_and_initiators() {
        let s = TargetSpec::parse(
            "iqn.2026-11.com.example:db=data@3,log;allow=iqn.1994-05.com.redhat:a+iqn.x.y:b",
        )
        .unwrap();
        assert_eq!(s.iqn, "iqn.2026-11.com.example:db");
        assert_eq!(
            s.luns,
            vec![("data".to_string(), Some(3)), ("log".to_string(), None)]
        );
        assert_eq!(
            s.initiators,
            Some(vec!["iqn.1994-05.com.redhat:a".into(), "iqn.x.y:b".into()])
        );
        // Numbered LUNs are added first, so the unnumbered one takes the lowest free (0).
        let calls = s.calls();
        assert_eq!(calls[0].method, "iscsi_target_create");
        assert_eq!(calls[0].params["allow"][1], "iqn.x.y:b");
        assert_eq!(calls[1].params["lun"], 3);
        assert_eq!(calls[2].params["export"], "log");
        assert!(calls[2].params.get("lun").is_none());
        let open = TargetSpec::parse("iqn.2026-11.com.example:t=a").unwrap();
        assert_eq!(open.initiators, None);
        assert!(open.calls()[0].params.get("allow").is_none());
    }

    #[test]
    fn bad_target_specs_say_what_is_wrong_naming_the_flag() {
        for (spec, why) in [
            ("iqn.2026-11.com.example:t", "no '='"),
            ("target=a", "bad target IQN"),
            ("iqn.2026-11.com.Example:t=a", "bad target IQN"),
            ("iqn.2026-11.io.blkwire:a=a", "exports' own targets"),
            ("iqn.2026-11.com.example:t=a@x", "bad LUN 'x'"),
            ("iqn.2026-11.com.example:t=a@16384", "bad LUN '16384'"),
            ("iqn.2026-11.com.example:t=a,,b", "empty export"),
            ("iqn.2026-11.com.example:t=a,a", "listed twice"),
            ("iqn.2026-11.com.example:t=a@1,b@1", "LUN 1 is given twice"),
            (
                "iqn.2026-11.com.example:t=a;allow=bob",
                "bad initiator IQN 'bob'",
            ),
            ("iqn.2026-11.com.example:t=a;serial=1", "unknown option"),
        ] {
            let e = TargetSpec::parse(spec).unwrap_err();
            assert!(
                e.starts_with("--iscsi-target ") && e.contains(why) && !e.contains('\n'),
                "{spec}: {e}"
            );
        }
        let many: Vec<String> = (0..=MAX_LUNS).map(|i| format!("e{i}")).collect();
        let e = TargetSpec::parse(&format!("iqn.2026-11.com.example:t={}", many.join(",")))
            .unwrap_err();
        assert!(e.contains("more than 32 LUNs"), "{e}");
    }

    #[test]
    fn luns_take_the_lowest_free_number_and_initiators_restrict_an_open_target() {
        let mut t = Targets::default();
        t.create("iqn.2026-11.com.example:t", None, false).unwrap();
        assert!(t.create("iqn.2026-11.com.example:t", None, false).is_err());
        assert!(t.create("iqn.2026-11.com.example:u", None, true).is_err());
        let iqn = "iqn.2026-11.com.example:t";
        assert_eq!(t.add_lun(iqn, "a", Some(1)), Ok(1));
        assert_eq!(t.add_lun(iqn, "b", None), Ok(0));
        assert_eq!(t.add_lun(iqn, "c", None), Ok(2));
        assert!(t.add_lun(iqn, "c", None).unwrap_err().contains("already"));
        assert!(t.add_lun(iqn, "d", Some(2)).unwrap_err().contains("in use"));
        assert_eq!(t.remove_lun(iqn, 0), Ok("b".to_string()));
        assert!(t.remove_lun(iqn, 0).is_err());
        assert_eq!(t.add_lun(iqn, "d", None), Ok(0));
        let target = t.get_mut(iqn).unwrap().clone();
        assert!(target.admits("iqn.anyone.at:all"));
        t.add_initiator(iqn, "iqn.2026-11.com.example:host")
            .unwrap();
        let target = t.get_mut(iqn).unwrap().clone();
        assert!(!target.admits("iqn.anyone.at:all"));
        assert!(target.admits("iqn.2026-11.com.example:host"));
        t.remove_initiator(iqn, "iqn.2026-11.com.example:host")
            .unwrap();
        assert!(!t
            .get_mut(iqn)
            .unwrap()
            .admits("iqn.2026-11.com.example:host"));
        assert!(t
            .remove_initiator(iqn, "iqn.2026-11.com.example:host")
            .is_err());
        t.delete(iqn).unwrap();
        assert!(t.delete(iqn).is_err());
    }
}
