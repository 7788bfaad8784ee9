//! Who this initiator is and how it reaches the target: `--host-id`, `--key`, `--encrypt`,
//! `--tls`, `--tls-ca`, shared by every command that opens a session or queries a target
//! (PROTOCOL.md §12).

use std::path::PathBuf;

use blkwire_client::ConnectOptions;

#[derive(clap::Args, Clone, Debug, Default)]
pub struct Identity {
    /// This host's id in the handshake (default: derived from /etc/machine-id)
    #[arg(long, value_name = "ID", env = "BLKWIRE_HOST_ID")]
    host_id: Option<String>,
    /// Key file (`blkwire key gen`); its line for the host id proves who this host is, and the
    /// target must prove it holds the same key
    #[arg(long, value_name = "FILE", env = "BLKWIRE_KEY_FILE")]
    key: Option<PathBuf>,
    /// udp:// and eth:// with a key: encrypt frames, not only authenticate them
    #[arg(long)]
    encrypt: bool,
    /// TLS 1.3 to a tcp:// target (one serving with --tls on|require): TLS-PSK with --key (the
    /// PSK identity is the host id), else X.509 verified against the system's CAs or --tls-ca
    #[arg(long)]
    tls: bool,
    /// CA certificates (PEM) the target's X.509 certificate must chain to; implies --tls
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<PathBuf>,
}

impl Identity {
    /// The identity options this command was given, for commands that take the identity from
    /// elsewhere (`map --recover`: the mapping's record). A host id or key file that came from
    /// BLKWIRE_HOST_ID or BLKWIRE_KEY_FILE is the environment's, not this command's (told apart
    /// by value: the same value also given on the command line passes too).
    pub fn options_given(&self) -> Vec<&'static str> {
        let from_env =
            |var: &str, v: &std::ffi::OsStr| std::env::var_os(var).is_some_and(|e| e == v);
        let mut given = Vec::new();
        if let Some(h) = &self.host_id {
            if !from_env("BLKWIRE_HOST_ID", h.as_ref()) {
                given.push("--host-id");
            }
        }
        if let Some(k) = &self.key {
            if !from_env("BLKWIRE_KEY_FILE", k.as_os_str()) {
                given.push("--key");
            }
        }
        if self.encrypt {
            given.push("--encrypt");
        }
        if self.tls {
            given.push("--tls");
        }
        if self.tls_ca.is_some() {
            given.push("--tls-ca");
        }
        given
    }

    /// What the client library and the map daemon take.
    pub fn credentials(&self) -> blkwire_client::Credentials {
        blkwire_client::Credentials {
            host_id: self.host_id.clone(),
            // Absolute: a mapping's daemon reads it again after it has left this directory.
            key_file: self
                .key
                .clone()
                .map(|p| std::fs::canonicalize(&p).unwrap_or(p)),
            encrypt: self.encrypt,
            tls: self.tls,
            tls_ca: self
                .tls_ca
                .clone()
                .map(|p| std::fs::canonicalize(&p).unwrap_or(p)),
        }
    }

    /// Fills the host id, key and encryption of `opts`; errors are one line.
    pub fn apply(&self, opts: &mut ConnectOptions) -> Result<(), String> {
        self.credentials().apply(opts)
    }

    /// `ConnectOptions::default()` with this identity.
    pub fn options(&self) -> Result<ConnectOptions, String> {
        let mut o = ConnectOptions::default();
        self.apply(&mut o)?;
        Ok(o)
    }
}

/// `blkwire key`.
#[derive(clap::Subcommand)]
pub enum KeyCmd {
    /// Write a new random key for a host to FILE (mode 0600): give the initiator the file
    /// (--key) and add its line to the target's key file (serve --keys)
    Gen {
        /// Where to write it (never overwritten)
        file: PathBuf,
        /// The host the key is for (default: this host's id, as the other commands take it)
        #[arg(long, value_name = "ID", env = "BLKWIRE_HOST_ID")]
        host_id: Option<String>,
    },
}

pub fn run_key(cmd: KeyCmd) -> Result<(), String> {
    match cmd {
        KeyCmd::Gen { file, host_id } => {
            let id = host_id.unwrap_or_else(blkwire_auth::default_host_id);
            blkwire_auth::keys::generate_file(&file, &id)?;
            println!(
                "wrote a key for host '{id}' to {} (mode 0600): the initiator uses it with \
                 --key {0}; append the same line to the target's --keys file",
                file.display()
            );
            Ok(())
        }
    }
}

/// `--timeout SECS` of the commands that wait for one answer (`info`, `stats`).
#[derive(clap::Args, Clone, Debug)]
pub struct AnswerTimeout {
    /// Seconds to wait for the target's answer
    #[arg(
        long,
        value_name = "SECS",
        default_value_t = 10.0,
        allow_negative_numbers = true
    )]
    timeout: f64,
}

impl AnswerTimeout {
    /// The timeout, or a one-line error when it is out of range.
    pub fn duration(&self) -> Result<std::time::Duration, String> {
        if !(0.001..=3600.0).contains(&self.timeout) {
            return Err(format!(
                "--timeout {}: give at least 0.001 and at most 3600 seconds",
                self.timeout
            ));
        }
        Ok(std::time::Duration::from_secs_f64(self.timeout))
    }
}
