//! `blkwire export`, `listener`, `subsystem`, `iscsi-target`, `session`, `save-config` and
//! `load-config`: a running target's exports, listeners and sessions changed and listed over
//! its control socket (crate::rpc, docs/MANAGEMENT.md). Each command is one call; this module
//! words the results.

use std::path::PathBuf;

use blkwire_backend::format_size;
use serde_json::{json, Value};

use crate::rpc::Socket;
use crate::table::{aligned, cell, Align};

/// `blkwire export`.
#[derive(clap::Subcommand)]
pub enum ExportCmd {
    /// Add an export to the running target, e.g. `export add disk0 file:/dev/nvme0n1,allow=db1`
    Add {
        /// The export's name, as initiators' URLs name it
        name: String,
        /// The backend and options, as `serve --export NAME=SPEC` takes them after `NAME=`:
        /// BACKEND[,ro][,allow=RULE[+RULE...]], e.g. mem:1G,ro
        spec: String,
        #[command(flatten)]
        socket: Socket,
    },
    /// Remove an export; refused while sessions use it unless --force
    Rm {
        /// The export to remove
        name: String,
        /// Close the export's sessions instead of refusing
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        socket: Socket,
    },
    /// Grow an export (file:, null: and rbd: exports), e.g. `export resize disk0 2T`
    ///
    /// Exports only grow: shrinking could cut off an end a connected session is using. A
    /// session keeps the size it was given when it connected (its I/O past that is refused);
    /// new sessions see the new size. A file: export's file is extended (sparse) unless it is
    /// that long already; a block device up to its size now (grow the device first); mem:
    /// exports are mapped at their size (remove and re-add them). To shrink, remove and re-add
    /// the export.
    Resize {
        /// The export to grow
        name: String,
        /// The new size: bytes or with a unit (512, 4k, 1M, 1G, 2T), a multiple of the export's
        /// logical block size
        size: String,
        #[command(flatten)]
        socket: Socket,
    },
    /// List the exports with their size, spec and open sessions
    Ls {
        /// Print the target's JSON result unchanged
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        socket: Socket,
    },
    /// Replace who may open an export (its allow= rules); sessions the new rules refuse are
    /// closed
    Allow {
        /// The export whose rules change
        name: String,
        /// Host ids, address prefixes or MACs joined by '+', as in allow= (e.g. db1+10.0.0.0/8)
        #[arg(value_name = "RULES", conflicts_with = "none")]
        rules: Option<String>,
        /// Remove the rules: every host the target admits may open the export
        #[arg(long)]
        none: bool,
        #[command(flatten)]
        socket: Socket,
    },
}

/// `blkwire listener`.
#[derive(clap::Subcommand)]
pub enum ListenerCmd {
    /// Listen on one more address (as `serve --listen` takes it; port 0 picks a free one and
    /// the bound address is printed)
    Add {
        /// tcp://ADDR[:PORT], nbd://ADDR[:PORT], nvme-tcp://ADDR[:PORT], iscsi://ADDR[:PORT],
        /// udp://ADDR[:PORT] or eth://IFACE
        url: String,
        #[command(flatten)]
        socket: Socket,
    },
    /// Stop listening on an address: tcp://, nbd://, nvme-tcp:// and iscsi:// connections it accepted go on; udp://
    /// and eth:// sessions on it end with its sockets
    Rm {
        /// The address as `listener ls` shows it
        url: String,
        #[command(flatten)]
        socket: Socket,
    },
    /// List the addresses the target listens on
    Ls {
        /// Print the target's JSON result unchanged
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        socket: Socket,
    },
}

/// `blkwire subsystem`: NVMe/TCP subsystems of several exports (every export is also its own
/// subsystem, nqn.2026-11.io.blkwire:NAME, which these commands do not change).
#[derive(clap::Subcommand)]
pub enum SubsystemCmd {
    /// Create a subsystem with no namespaces yet; only hosts added with `subsystem add-host`
    /// may connect unless --allow-any-host
    Add {
        /// Its NQN, e.g. nqn.2026-11.com.example:db
        nqn: String,
        /// Identify Controller serial number (up to 20 ASCII characters) [default: from the NQN]
        #[arg(long)]
        serial: Option<String>,
        /// Identify Controller model number (up to 40 ASCII characters) [default: blkwire]
        #[arg(long)]
        model: Option<String>,
        /// Any host NQN may connect (the exports' allow= rules and --keys still apply)
        #[arg(long)]
        allow_any_host: bool,
        #[command(flatten)]
        socket: Socket,
    },
    /// Delete a subsystem; its controllers end
    Rm {
        /// Its NQN
        nqn: String,
        #[command(flatten)]
        socket: Socket,
    },
    /// Add an export as a namespace; hosts see it when they connect again
    AddNs {
        /// The subsystem's NQN
        nqn: String,
        /// The export
        export: String,
        /// The namespace id [default: the lowest free one]
        #[arg(long)]
        nsid: Option<u32>,
        #[command(flatten)]
        socket: Socket,
    },
    /// Remove a namespace; connected controllers answer Invalid Namespace for it from then on
    RmNs {
        /// The subsystem's NQN
        nqn: String,
        /// The namespace id
        nsid: u32,
        #[command(flatten)]
        socket: Socket,
    },
    /// Let a host NQN connect
    AddHost {
        /// The subsystem's NQN
        nqn: String,
        /// The host's NQN
        host: String,
        #[command(flatten)]
        socket: Socket,
    },
    /// Stop letting a host NQN connect; its controllers of the subsystem end
    RmHost {
        /// The subsystem's NQN
        nqn: String,
        /// The host's NQN
        host: String,
        #[command(flatten)]
        socket: Socket,
    },
    /// List every subsystem (each export's own, then the configured ones)
    Ls {
        /// Print the target's JSON result unchanged
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        socket: Socket,
    },
}

/// `blkwire iscsi-target`: iSCSI targets of several LUNs (every export is also its own target,
/// iqn.2026-11.io.blkwire:NAME with LUN 0, which these commands do not change).
#[derive(clap::Subcommand)]
pub enum IscsiTargetCmd {
    /// Create a target with no LUNs yet; with --allow only the initiators named may log in
    /// (more with `iscsi-target add-initiator`), without it any initiator may
    #[command(visible_alias = "add")]
    Create {
        /// Its IQN, e.g. iqn.2026-11.com.example:db
        iqn: String,
        /// An initiator IQN that may log in (repeatable)
        #[arg(long, value_name = "INITIATOR_IQN")]
        allow: Vec<String>,
        #[command(flatten)]
        socket: Socket,
    },
    /// Delete a target; its sessions end
    #[command(visible_alias = "rm")]
    Delete {
        /// Its IQN
        iqn: String,
        #[command(flatten)]
        socket: Socket,
    },
    /// Add an export as a LUN; initiators see it when they log in again
    AddLun {
        /// The target's IQN
        iqn: String,
        /// The export
        export: String,
        /// The LUN [default: the lowest free one]
        #[arg(long)]
        lun: Option<u64>,
        #[command(flatten)]
        socket: Socket,
    },
    /// Remove a LUN; logged-in sessions answer LOGICAL UNIT NOT SUPPORTED for it from then on
    RemoveLun {
        /// The target's IQN
        iqn: String,
        /// The LUN
        lun: u64,
        #[command(flatten)]
        socket: Socket,
    },
    /// Let an initiator IQN log in (a target that admitted any initiator then admits only
    /// its list)
    AddInitiator {
        /// The target's IQN
        iqn: String,
        /// The initiator's IQN
        initiator: String,
        #[command(flatten)]
        socket: Socket,
    },
    /// Stop letting an initiator IQN log in; its sessions of the target end
    RemoveInitiator {
        /// The target's IQN
        iqn: String,
        /// The initiator's IQN
        initiator: String,
        #[command(flatten)]
        socket: Socket,
    },
    /// List every target (each export's own, then the configured ones)
    #[command(visible_alias = "ls")]
    List {
        /// Print the target's JSON result unchanged
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        socket: Socket,
    },
}

/// `blkwire session`.
#[derive(clap::Subcommand)]
pub enum SessionCmd {
    /// List the open sessions: id, export, host, peer address and queues
    Ls {
        /// Print the target's JSON result unchanged
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        socket: Socket,
    },
    /// Close a session (its initiator sees its I/O fail, or reconnects)
    Close {
        /// The session id, as `session ls` shows it
        id: u32,
        #[command(flatten)]
        socket: Socket,
    },
}

#[derive(clap::Args)]
pub struct SaveConfigArgs {
    /// Write the config to this file on this host (atomically: a temporary file renamed over
    /// it), as the user running this command; without it the config goes to stdout. To have the
    /// target write a file itself, on its side, use `blkwire rpc save_config '{"path":"..."}'`
    #[arg(value_name = "FILE")]
    file: Option<PathBuf>,
    #[command(flatten)]
    socket: Socket,
}

#[derive(clap::Args)]
pub struct LoadConfigArgs {
    /// A config `save-config` wrote: a JSON array of {"method","params"} calls, read on this
    /// host and sent to the target
    #[arg(value_name = "FILE")]
    file: PathBuf,
    #[command(flatten)]
    socket: Socket,
}

pub fn run_export(cmd: ExportCmd) -> Result<(), String> {
    match cmd {
        ExportCmd::Add { name, spec, socket } => {
            // A relative file: path is this shell's, not the target's working directory.
            let spec = match blkwire_backend::ExportSpec::parse(&format!("{name}={spec}")) {
                Ok(s) => s.absolute().options(),
                Err(_) => spec, // the target says what is wrong with it
            };
            let entry = socket.call("export_add", Some(json!({"name": name, "spec": spec})))?;
            let ro = if entry["read_only"] == true {
                ", read-only"
            } else {
                ""
            };
            println!("added export {name} ({}{ro})", size(&entry["size"]));
        }
        ExportCmd::Rm {
            name,
            force,
            socket,
        } => {
            let r = socket.call("export_remove", Some(json!({"name": name, "force": force})))?;
            println!("removed export {name}{}", closed_sessions(&r));
        }
        ExportCmd::Resize {
            name,
            size: s,
            socket,
        } => {
            let entry = socket.call("export_resize", Some(json!({"name": name, "size": s})))?;
            println!(
                "resized export {name} to {} (was {})",
                size(&entry["size"]),
                size(&entry["previous_size"])
            );
        }
        ExportCmd::Ls { json, socket } => {
            let list = socket.call("export_list", None)?;
            print_list(
                json,
                &list,
                &[
                    ("name", Align::Left),
                    ("size", Align::Right),
                    ("spec", Align::Left),
                    ("sessions", Align::Right),
                ],
                |e| {
                    vec![
                        cell(&e["name"]),
                        size(&e["size"]),
                        cell(&e["spec"]),
                        cell(&e["sessions"]),
                    ]
                },
                "no exports (`blkwire export add NAME SPEC` adds one)",
            );
        }
        ExportCmd::Allow {
            name,
            rules,
            none,
            socket,
        } => {
            let allow = match (rules, none) {
                // Likely an unset variable (`export allow disk0 "$RULES"`): not taken as --none.
                (Some(r), _) if r.is_empty() => {
                    return Err(format!(
                        "export allow got empty RULES for {name} (an unset variable?): give the \
                         rules (e.g. db1+10.0.0.0/8), or --none to remove them"
                    ))
                }
                (Some(r), _) => Value::String(r),
                (None, true) => Value::Null,
                (None, false) => {
                    return Err(format!(
                        "export allow needs the RULES that replace {name}'s (e.g. \
                         db1+10.0.0.0/8) or --none to remove them"
                    ))
                }
            };
            let r = socket.call(
                "export_set_allow",
                Some(json!({"name": name, "allow": allow})),
            )?;
            match allow.as_str() {
                Some(rules) => print!("export {name} now allows {rules}"),
                None => print!("export {name} has no allow rules now"),
            }
            println!("{}", closed_sessions(&r));
        }
    }
    Ok(())
}

pub fn run_listener(cmd: ListenerCmd) -> Result<(), String> {
    match cmd {
        ListenerCmd::Add { url, socket } => {
            let r = socket.call("listener_add", Some(json!({"url": url})))?;
            println!("listening on {}", cell(&r["url"]));
        }
        ListenerCmd::Rm { url, socket } => {
            let r = socket.call("listener_remove", Some(json!({"url": url})))?;
            println!("stopped listening on {}", cell(&r["url"]));
        }
        ListenerCmd::Ls { json, socket } => {
            let list = socket.call("listener_list", None)?;
            print_list(
                json,
                &list,
                &[("url", Align::Left), ("kind", Align::Left)],
                |l| vec![cell(&l["url"]), cell(&l["kind"])],
                "no listeners (`blkwire listener add URL` adds one)",
            );
        }
    }
    Ok(())
}

pub fn run_subsystem(cmd: SubsystemCmd) -> Result<(), String> {
    match cmd {
        SubsystemCmd::Add {
            nqn,
            serial,
            model,
            allow_any_host,
            socket,
        } => {
            let mut p = json!({"nqn": nqn, "allow_any_host": allow_any_host});
            if let Some(s) = serial {
                p["serial"] = s.into();
            }
            if let Some(m) = model {
                p["model"] = m.into();
            }
            let r = socket.call("nvme_subsystem_create", Some(p))?;
            println!(
                "created subsystem {} (serial {}, model {})",
                cell(&r["nqn"]),
                cell(&r["serial"]),
                cell(&r["model"])
            );
        }
        SubsystemCmd::Rm { nqn, socket } => {
            let r = socket.call("nvme_subsystem_delete", Some(json!({"nqn": nqn})))?;
            println!("deleted subsystem {nqn}{}", closed_sessions(&r));
        }
        SubsystemCmd::AddNs {
            nqn,
            export,
            nsid,
            socket,
        } => {
            let mut p = json!({"nqn": nqn, "export": export});
            if let Some(id) = nsid {
                p["nsid"] = id.into();
            }
            let r = socket.call("nvme_subsystem_add_ns", Some(p))?;
            println!("export {export} is namespace {} of {nqn}", cell(&r["nsid"]));
        }
        SubsystemCmd::RmNs { nqn, nsid, socket } => {
            let r = socket.call(
                "nvme_subsystem_remove_ns",
                Some(json!({"nqn": nqn, "nsid": nsid})),
            )?;
            println!(
                "removed namespace {nsid} (export {}) of {nqn}{}",
                cell(&r["export"]),
                closed_sessions(&r)
            );
        }
        SubsystemCmd::AddHost { nqn, host, socket } => {
            socket.call(
                "nvme_subsystem_add_host",
                Some(json!({"nqn": nqn, "host": host})),
            )?;
            println!("host {host} may connect to {nqn}");
        }
        SubsystemCmd::RmHost { nqn, host, socket } => {
            let r = socket.call(
                "nvme_subsystem_remove_host",
                Some(json!({"nqn": nqn, "host": host})),
            )?;
            println!(
                "host {host} may no longer connect to {nqn}{}",
                closed_sessions(&r)
            );
        }
        SubsystemCmd::Ls { json, socket } => {
            let list = socket.call("nvme_subsystem_list", None)?;
            print_list(
                json,
                &list,
                &[
                    ("nqn", Align::Left),
                    ("namespaces", Align::Left),
                    ("hosts", Align::Left),
                    ("controllers", Align::Right),
                ],
                |s| {
                    let ns = numbered(&s["namespaces"], "nsid");
                    let hosts = admitted(s, "allow_any_host", "hosts");
                    let ctrls = s["controllers"].as_array().map_or(0, Vec::len);
                    vec![cell(&s["nqn"]), ns, hosts, ctrls.to_string()]
                },
                "no subsystems",
            );
        }
    }
    Ok(())
}

/// An NVMe subsystem's namespaces or an iSCSI target's LUNs as `NUMBER=EXPORT,...`, the
/// number under `key` in each.
fn numbered(members: &Value, key: &str) -> String {
    members.as_array().map_or(String::new(), |v| {
        v.iter()
            .map(|m| format!("{}={}", cell(&m[key]), cell(&m["export"])))
            .collect::<Vec<_>>()
            .join(",")
    })
}

/// Who may connect to a listed subsystem or target: `any` for an export's own one or a
/// configured one whose `any_key` is set, else its `list_key` names joined.
fn admitted(item: &Value, any_key: &str, list_key: &str) -> String {
    if item["configured"] != true || item[any_key] == true {
        return "any".to_string();
    }
    item[list_key].as_array().map_or(String::new(), |v| {
        v.iter().map(cell).collect::<Vec<_>>().join(",")
    })
}

pub fn run_iscsi_target(cmd: IscsiTargetCmd) -> Result<(), String> {
    match cmd {
        IscsiTargetCmd::Create { iqn, allow, socket } => {
            let mut p = json!({"iqn": iqn});
            if !allow.is_empty() {
                p["allow"] = allow.into();
            }
            socket.call("iscsi_target_create", Some(p))?;
            println!("created target {iqn}");
        }
        IscsiTargetCmd::Delete { iqn, socket } => {
            let r = socket.call("iscsi_target_delete", Some(json!({"iqn": iqn})))?;
            println!("deleted target {iqn}{}", closed_sessions(&r));
        }
        IscsiTargetCmd::AddLun {
            iqn,
            export,
            lun,
            socket,
        } => {
            let mut p = json!({"iqn": iqn, "export": export});
            if let Some(l) = lun {
                p["lun"] = l.into();
            }
            let r = socket.call("iscsi_target_add_lun", Some(p))?;
            println!("export {export} is LUN {} of {iqn}", cell(&r["lun"]));
        }
        IscsiTargetCmd::RemoveLun { iqn, lun, socket } => {
            let r = socket.call(
                "iscsi_target_remove_lun",
                Some(json!({"iqn": iqn, "lun": lun})),
            )?;
            println!(
                "removed LUN {lun} (export {}) of {iqn}{}",
                cell(&r["export"]),
                closed_sessions(&r)
            );
        }
        IscsiTargetCmd::AddInitiator {
            iqn,
            initiator,
            socket,
        } => {
            let r = socket.call(
                "iscsi_target_add_initiator",
                Some(json!({"iqn": iqn, "initiator": initiator})),
            )?;
            println!(
                "initiator {initiator} may log in to {iqn}{}",
                closed_sessions(&r)
            );
        }
        IscsiTargetCmd::RemoveInitiator {
            iqn,
            initiator,
            socket,
        } => {
            let r = socket.call(
                "iscsi_target_remove_initiator",
                Some(json!({"iqn": iqn, "initiator": initiator})),
            )?;
            println!(
                "initiator {initiator} may no longer log in to {iqn}{}",
                closed_sessions(&r)
            );
        }
        IscsiTargetCmd::List { json, socket } => {
            let list = socket.call("iscsi_target_list", None)?;
            print_list(
                json,
                &list,
                &[
                    ("iqn", Align::Left),
                    ("luns", Align::Left),
                    ("initiators", Align::Left),
                    ("sessions", Align::Right),
                ],
                |t| {
                    let luns = numbered(&t["luns"], "lun");
                    let initiators = admitted(t, "any_initiator", "initiators");
                    let sessions = t["sessions"].as_array().map_or(0, Vec::len);
                    vec![cell(&t["iqn"]), luns, initiators, sessions.to_string()]
                },
                "no iSCSI targets",
            );
        }
    }
    Ok(())
}

pub fn run_session(cmd: SessionCmd) -> Result<(), String> {
    match cmd {
        SessionCmd::Ls { json, socket } => {
            let list = socket.call("session_list", None)?;
            let columns = [
                ("session", Align::Left),
                ("export", Align::Left),
                ("host", Align::Left),
                ("peer", Align::Left),
                ("queues", Align::Right),
            ];
            print_list(
                json,
                &list,
                &columns,
                |s| columns.iter().map(|(k, _)| cell(&s[k])).collect(),
                "no sessions",
            );
        }
        SessionCmd::Close { id, socket } => {
            socket.call("session_close", Some(json!({"session": id})))?;
            println!("closed session {id}");
        }
    }
    Ok(())
}

pub fn run_save_config(a: SaveConfigArgs) -> Result<(), String> {
    let config = a.socket.call("save_config", None)?;
    let calls = config.as_array().map(Vec::as_slice).unwrap_or_default();
    let text = blkwire_server::config_text(calls);
    match a.file {
        None => print!("{text}"),
        Some(file) => {
            // Owner only, as the target writes it (it names key files and devices).
            blkwire_server::write_private(&file, text.as_bytes())
                .map_err(|e| format!("cannot write {}: {e}", file.display()))?;
            println!(
                "saved {} to {}",
                counted(calls.len() as u64, "call"),
                file.display()
            );
        }
    }
    Ok(())
}

/// Reads a config as the invoking user gave it, a regular file or a pipe (`--config <(...)`),
/// of at most `MAX_CONFIG_FILE` bytes: /dev/zero is refused after that much, not read until
/// memory runs out. The error says what is wrong, without the path (the caller names it).
pub fn read_config(path: &std::path::Path) -> Result<String, String> {
    use std::io::Read;
    let max = blkwire_server::MAX_CONFIG_FILE;
    let f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut bytes = Vec::new();
    f.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > max {
        return Err(format!(
            "larger than {} MiB, the most read: is it the right file?",
            max >> 20
        ));
    }
    String::from_utf8(bytes).map_err(|_| "not text (invalid UTF-8)".to_string())
}

pub fn run_load_config(a: LoadConfigArgs) -> Result<(), String> {
    let file = a.file.display();
    let text = read_config(&a.file).map_err(|e| format!("cannot read {file}: {e}"))?;
    let config: Value =
        serde_json::from_str(&text).map_err(|e| format!("{file} is not JSON: {e}"))?;
    if !config.is_array() {
        return Err(format!(
            "{file} is not a config: one is a JSON array of {{\"method\",\"params\"}} calls, as \
             `blkwire save-config FILE` writes"
        ));
    }
    // A config too large for one request line (the target takes lines of up to 1 MiB) goes
    // by its path instead: the control socket is local, so the target reads the same file.
    // Measured as sent (compact JSON), not as written (`save-config` puts a call per line).
    let inline = json!({ "config": config });
    let params = if inline.to_string().len() + 256 < blkwire_server::MAX_RPC_REQUEST {
        inline
    } else if !std::fs::metadata(&a.file).is_ok_and(|m| m.is_file()) {
        // Read from a pipe or a device, it cannot be read again by the target.
        return Err(format!(
            "{file}: a config too large for one request line (1 MiB) goes to the target by \
             its path, so it must be a regular file (not a pipe)"
        ));
    } else {
        let path = std::fs::canonicalize(&a.file).map_err(|e| format!("{file}: {e}"))?;
        json!({ "path": path })
    };
    let r = a.socket.call("load_config", Some(params))?;
    match r["applied"].as_u64() {
        Some(n) => println!("applied {} from {file}", counted(n, "call")),
        None => println!("applied {file}"),
    }
    Ok(())
}

/// A size in bytes as `format_size` words it; `-` if the target sent none.
fn size(v: &Value) -> String {
    v.as_u64().map_or_else(|| cell(v), format_size)
}

/// ` (closed N sessions)` when a change closed some, else nothing.
fn closed_sessions(result: &Value) -> String {
    match result["closed_sessions"].as_u64() {
        None | Some(0) => String::new(),
        Some(n) => format!(" (closed {})", counted(n, "session")),
    }
}

/// `1 call`, `2 calls`.
fn counted(n: u64, thing: &str) -> String {
    if n == 1 {
        format!("1 {thing}")
    } else {
        format!("{n} {thing}s")
    }
}

/// A list result: its JSON with --json, else a table of `columns` (headers and alignment) with
/// one `row` per element, or `if_empty` on stderr (stdout stays empty for scripts that count
/// lines).
fn print_list(
    json: bool,
    list: &Value,
    columns: &[(&str, Align)],
    row: impl Fn(&Value) -> Vec<String>,
    if_empty: &str,
) {
    if json {
        println!("{}", crate::table::pretty_json_for_terminal(list));
        return;
    }
    let items = list.as_array().map_or(&[][..], Vec::as_slice);
    if items.is_empty() {
        eprintln!("{if_empty}");
        return;
    }
    let mut rows = vec![columns.iter().map(|(h, _)| h.to_string()).collect()];
    rows.extend(items.iter().map(row));
    let align: Vec<Align> = columns.iter().map(|&(_, a)| a).collect();
    print!("{}", aligned(&rows, &align));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_sessions_are_counted_in_words() {
        assert_eq!(closed_sessions(&json!({"closed_sessions": 0})), "");
        assert_eq!(
            closed_sessions(&json!({"closed_sessions": 1})),
            " (closed 1 session)"
        );
        assert_eq!(
            closed_sessions(&json!({"closed_sessions": 2})),
            " (closed 2 sessions)"
        );
    }
}
