//! `blkwire`: the command line. Each subcommand lives in its own module; errors come back as one
//! line and a non-zero exit.

// The doc comments of the argument structs are `--help` text written for a terminal
// (`tcp://HOST[:PORT]/EXPORT`), not rustdoc: their brackets are not links.
#![allow(rustdoc::broken_intra_doc_links)]

mod bench;
mod copy;
mod cp;
mod discover;
mod hist;
mod identity;
mod info;
mod manage;
mod map;
mod rpc;
mod serve;
mod stats;
mod table;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "blkwire",
    version,
    about = "Network block storage: export disks, files and RAM; use them from other hosts",
    long_about = "Network block storage in userspace.\n\n\
        A target (`blkwire serve`) exports block devices, files and RAM over blkwire's own protocol.\n\
        Initiators name an export by URL (tcp://HOST[:PORT]/EXPORT, udp://HOST[:PORT]/EXPORT,\n\
        eth://IFACE/MAC/EXPORT, or nvme-tcp://HOST[:PORT]/NQN for any NVMe/TCP target)\n\
        to inspect it (`info`), copy to and from it (`cp`), measure it\n\
        (`bench`) or map it as a local block device (`map`); stock NBD clients use nbd:// listeners,\n\
        NVMe/TCP hosts (the Linux kernel, nvme-cli) nvme-tcp:// ones.\n\n\
        A running target's exports, listeners and sessions change over its control socket\n\
        (`export`, `listener`, `session`, `save-config`, `load-config`, `rpc`)."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Export backends over the network until SIGINT/SIGTERM
    Serve(Box<serve::Args>),
    /// Show an export's size, block sizes, features and limits (or list a target's exports)
    Info(info::Args),
    /// Measure IOPS, bandwidth and latency against an export
    Bench(bench::Args),
    /// Copy between local files/devices and exports (either side may be a URL); between two
    /// exports of one target the target copies itself
    Cp(cp::Args),
    /// Copy ranges inside a target (within an export, or from another export of it): no data
    /// crosses the network
    Copy(copy::Args),
    /// Show a target's live per-queue counters
    Stats(stats::Args),
    /// Find targets and their exports on a link (raw Ethernet broadcast) or at a UDP address
    /// (exit status 1 when none answered)
    Discover(discover::Args),
    /// Make an export a local block device (prints it, e.g. /dev/loop3)
    Map(map::MapArgs),
    /// Remove a mapped block device (refused while it is mounted or held: a partition of it
    /// mounted, a mount in another mount namespace, device-mapper, md or swap on it)
    Unmap(map::UnmapArgs),
    /// List mapped block devices and whether their daemons are alive
    Ls(map::LsArgs),
    /// Manage pre-shared keys (`key gen FILE`)
    #[command(subcommand)]
    Key(identity::KeyCmd),
    /// Add, remove and list a running target's exports, and change who may open them
    ///
    /// Over the control socket of a running `blkwire serve` (--socket, default
    /// /run/blkwire/blkwire.sock): only root or the user running serve may use it.
    #[command(subcommand)]
    Export(manage::ExportCmd),
    /// Add, remove and list the addresses a running target listens on
    ///
    /// Over the control socket of a running `blkwire serve` (--socket, default
    /// /run/blkwire/blkwire.sock): only root or the user running serve may use it.
    #[command(subcommand)]
    Listener(manage::ListenerCmd),
    /// Create, change, delete and list a running target's NVMe/TCP subsystems
    ///
    /// Over the control socket of a running `blkwire serve` (--socket, default
    /// /run/blkwire/blkwire.sock): only root or the user running serve may use it.
    #[command(subcommand)]
    Subsystem(manage::SubsystemCmd),
    /// Create, change, delete and list a running target's iSCSI targets of several LUNs
    ///
    /// Over the control socket of a running `blkwire serve` (--socket, default
    /// /run/blkwire/blkwire.sock): only root or the user running serve may use it.
    #[command(subcommand)]
    IscsiTarget(manage::IscsiTargetCmd),
    /// List and close a running target's sessions
    ///
    /// Over the control socket of a running `blkwire serve` (--socket, default
    /// /run/blkwire/blkwire.sock): only root or the user running serve may use it.
    #[command(subcommand)]
    Session(manage::SessionCmd),
    /// Print a running target's exports, listeners and settings as a config (or write it to FILE)
    ///
    /// The config is a JSON array of {"method","params"} calls that `load-config` applies again.
    /// Over the control socket of a running `blkwire serve` (--socket, default
    /// /run/blkwire/blkwire.sock): only root or the user running serve may use it.
    SaveConfig(manage::SaveConfigArgs),
    /// Apply a config (from `save-config`) to a running target
    ///
    /// Each call of the file is applied in order, as if sent one by one. Over the control
    /// socket of a running `blkwire serve` (--socket, default /run/blkwire/blkwire.sock): only
    /// root or the user running serve may use it.
    LoadConfig(manage::LoadConfigArgs),
    /// Send one JSON-RPC call to a running target's control socket and print its result
    ///
    /// E.g. `blkwire rpc export_list` or `blkwire rpc export_add '{"name":"disk0","spec":"mem:1G"}'`;
    /// `blkwire rpc rpc_get_methods` lists the methods, docs/MANAGEMENT.md describes them. The
    /// control socket is the one of a running `blkwire serve` (--socket, default
    /// /run/blkwire/blkwire.sock): only root or the user running serve may use it.
    Rpc(rpc::Args),
}

/// print! panics when stdout cannot be written (a full disk, a closed pipe of a command that
/// goes on after SIGPIPE): said in one line with exit status 1, as any other failure, instead
/// of a panic message. Other panics keep the default report.
fn output_failures_are_errors() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied());
        if let Some(e) = msg.and_then(|m| m.strip_prefix("failed printing to stdout: ")) {
            eprintln!("blkwire: error: cannot write the output: {e}");
            std::process::exit(1);
        }
        default(info);
    }));
}

fn main() -> ExitCode {
    output_failures_are_errors();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        // Bare `blkwire` (or a bare command group): the help is the answer, not an error line.
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            e.exit()
        }
        Err(e) => {
            eprintln!("blkwire: error: {} (try --help)", one_line(&e.to_string()));
            return ExitCode::from(2);
        }
    };
    if matches!(
        cli.cmd,
        Command::Info(_)
            | Command::Stats(_)
            | Command::Discover(_)
            | Command::Ls(_)
            | Command::Bench(_)
            | Command::Copy(_)
            | Command::Key(_)
            | Command::Export(_)
            | Command::Listener(_)
            | Command::Subsystem(_)
            | Command::IscsiTarget(_)
            | Command::Session(_)
            | Command::SaveConfig(_)
            | Command::LoadConfig(_)
            | Command::Rpc(_)
    ) {
        // Commands that print for a pipe end quietly when the reader goes (`| head`), as
        // other Unix tools do, instead of panicking on EPIPE. Their sockets write with
        // MSG_NOSIGNAL (the control socket's too, crate::rpc), so only stdout can raise the
        // signal.
        // SAFETY: setting a signal's disposition before any thread is started.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let r = match cli.cmd {
        Command::Serve(a) => serve::run(*a),
        Command::Info(a) => info::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Cp(a) => cp::run(a),
        Command::Copy(a) => copy::run(a),
        Command::Stats(a) => stats::run(a),
        Command::Discover(a) => discover::run(a),
        Command::Map(a) => map::run_map(a),
        Command::Unmap(a) => map::run_unmap(a),
        Command::Ls(a) => map::run_ls(a),
        Command::Key(k) => identity::run_key(k),
        Command::Export(c) => manage::run_export(c),
        Command::Listener(c) => manage::run_listener(c),
        Command::Subsystem(c) => manage::run_subsystem(c),
        Command::IscsiTarget(c) => manage::run_iscsi_target(c),
        Command::Session(c) => manage::run_session(c),
        Command::SaveConfig(a) => manage::run_save_config(a),
        Command::LoadConfig(a) => manage::run_load_config(a),
        Command::Rpc(a) => rpc::run(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("blkwire: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One line, like every other blkwire error, from clap's multi-line block: the message with
/// what clap lists under it (the missing arguments, the possible values, a similar argument's
/// name), without the usage and the pointer to --help.
fn one_line(clap_msg: &str) -> String {
    let parts: Vec<String> = clap_msg
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .map(|l| match l.strip_prefix("tip: ") {
            // "did you mean" hints stay, in brackets, on the same line.
            Some(tip) => format!("({tip})"),
            None => l.to_string(),
        })
        .collect();
    let joined = parts.join(" ");
    let msg = joined.strip_prefix("error: ").unwrap_or(&joined);
    if msg.is_empty() {
        "bad arguments".into()
    } else {
        msg.to_string()
    }
}

/// clap value parser for sizes like `4k`, `1M`.
pub fn size_arg(s: &str) -> Result<u64, String> {
    blkwire_backend::parse_size(s)
}

/// Opens a session, turning library errors into one-line messages.
pub fn open(
    url: &str,
    opts: &blkwire_client::ConnectOptions,
) -> Result<blkwire_client::Session, String> {
    let u = blkwire_client::Url::parse(url).map_err(|e| e.to_string())?;
    if u.export.is_empty() {
        return Err(format!("'{url}' names no export: use tcp://HOST:PORT/EXPORT (`blkwire info tcp://HOST:PORT` lists them)"));
    }
    let s = blkwire_client::connect(&u, opts).map_err(|e| e.to_string())?;
    // Every command runs its work on the queues: none would be a copy or run that did nothing.
    if s.queues.is_empty() {
        return Err(format!("{url}: the target granted no queue"));
    }
    Ok(s)
}
