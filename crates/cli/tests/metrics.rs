//! `serve --metrics`: the Prometheus endpoint scraped with curl after known I/O, its format
//! checked line by line here and by promtool, and hostile HTTP clients that must neither hang
//! nor crash the target.

mod common;

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use blkwire_client::{connect, ConnectOptions, Session, Url};
use common::{assert_one_line_error, cli, random_bytes, spawn_serve_with_metrics, Target, TempDir};

/// A target with `--metrics` on a free loopback port, two reactors, and these exports; its
/// tcp:// URL is `base`, its udp:// URL the second.
fn start(exports: &[&str]) -> (Target, String, String) {
    let mut cmd = Command::new(common::BIN);
    cmd.args([
        "serve",
        "--listen",
        "tcp://127.0.0.1:0",
        "--listen",
        "udp://127.0.0.1:0",
        "--metrics",
        "127.0.0.1:0",
        "--threads",
        "2",
        "--log-level",
        "warn",
        "--rpc-socket",
        "none",
    ]);
    for e in exports {
        cmd.args(["--export", e]);
    }
    let (child, urls, metrics) = spawn_serve_with_metrics(&mut cmd, 2);
    assert!(
        metrics.starts_with("http://127.0.0.1:") && metrics.ends_with("/metrics"),
        "{metrics}"
    );
    let base = urls[0].clone();
    (Target { child, base }, urls[1].clone(), metrics)
}

/// GETs `url` with curl: (status code, body).
fn curl(url: &str) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "30", "--write-out", "\n%{http_code}", url])
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run curl ({e}): the test scrapes with it; install it (apt-get install curl)")
        });
    let text = String::from_utf8(out.stdout).expect("UTF-8 metrics");
    let (body, code) = text.rsplit_once('\n').expect("curl wrote the status code");
    assert!(
        out.status.success(),
        "curl {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (code.parse().expect("a status code"), body.to_string())
}

/// A scrape that must succeed; its samples checked against the format.
fn scrape(url: &str) -> Samples {
    let (code, body) = curl(url);
    assert_eq!(code, 200, "{body}");
    Samples::parse(&body)
}

/// `promtool check metrics` (the Prometheus project's own linter) on a scrape.
fn promtool_check(text: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run promtool ({e}): it checks the scrape; install Debian's prometheus \
                 package (apt-get install prometheus; scripts/deps.sh installs it)"
            )
        });
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A sample's name and labels (sorted), or a histogram's family and labels without `le`.
type Series = (String, Vec<(String, String)>);

/// A scrape, parsed and checked: every sample's family has HELP and TYPE before it and its
/// lines are together, names and labels are valid, values are numbers, no series twice,
/// counters end in `_total` and never go below 0, histogram buckets never go down and end
/// with `+Inf`, which equals `_count`.
struct Samples {
    text: String,
    values: HashMap<Series, f64>,
}

impl Samples {
    fn parse(text: &str) -> Samples {
        let mut types: HashMap<String, String> = HashMap::new();
        let mut helps: HashSet<String> = HashSet::new();
        let mut done: HashSet<String> = HashSet::new();
        let mut current: Option<String> = None;
        let mut values = HashMap::new();
        // Each histogram's buckets, (le, count) in order, its _count and whether it has _sum.
        let mut buckets: HashMap<Series, Vec<(f64, f64)>> = HashMap::new();
        let mut counts = HashMap::new();
        let mut sums = HashSet::new();
        assert!(text.ends_with('\n'), "the last line ends with a newline");
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap();
                assert!(valid_name(name), "{line}");
                assert!(helps.insert(name.to_string()), "HELP twice: {line}");
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect(line);
                assert!(valid_name(name), "{line}");
                assert!(
                    ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                    "{line}"
                );
                assert!(
                    types.insert(name.to_string(), kind.to_string()).is_none(),
                    "TYPE twice: {line}"
                );
                continue;
            }
            assert!(!line.starts_with('#') && !line.is_empty(), "{line:?}");
            let (name, labels, value) = parse_sample(line);
            let family =
                family_of(&name, &types).unwrap_or_else(|| panic!("no TYPE before {line}"));
            assert!(helps.contains(&family), "no HELP before {line}");
            if current.as_ref() != Some(&family) {
                if let Some(prev) = current.replace(family.clone()) {
                    done.insert(prev);
                }
                assert!(
                    !done.contains(&family),
                    "{family}'s lines are not together: {line}"
                );
            }
            let kind = &types[&family];
            if kind == "counter" {
                assert!(name.ends_with("_total") && value >= 0.0, "{line}");
            }
            if kind == "histogram" {
                let mut rest: Vec<_> = labels.iter().filter(|(k, _)| k != "le").cloned().collect();
                rest.sort();
                let key = (family.clone(), rest);
                if name.ends_with("_bucket") {
                    let le = labels.iter().find(|(k, _)| k == "le").expect(line);
                    let le = parse_value(&le.1).expect(line);
                    buckets.entry(key).or_default().push((le, value));
                } else if name.ends_with("_count") {
                    counts.insert(key, value);
                } else {
                    sums.insert(key);
                }
            }
            let mut sorted = labels.clone();
            sorted.sort();
            assert!(
                values.insert((name, sorted), value).is_none(),
                "series twice: {line}"
            );
        }
        assert!(!buckets.is_empty(), "no histogram in:\n{text}");
        for (key, b) in &buckets {
            for w in b.windows(2) {
                assert!(
                    w[0].0 < w[1].0 && w[0].1 <= w[1].1,
                    "{key:?}: buckets {w:?}"
                );
            }
            let (le, inf) = *b.last().unwrap();
            assert_eq!(le, f64::INFINITY, "{key:?}: the last bucket is +Inf");
            assert_eq!(counts.get(key), Some(&inf), "{key:?}: +Inf equals _count");
            assert!(sums.contains(key), "{key:?}: no _sum");
        }
        assert_eq!(counts.len(), buckets.len(), "a _count without buckets");
        Samples {
            text: text.to_string(),
            values,
        }
    }

    /// The value of the series `name{labels}` (labels in any order); None if absent.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut l: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        l.sort();
        self.values.get(&(name.to_string(), l)).copied()
    }

    /// Like [`Samples::get`], for a series that must be there.
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels)
            .unwrap_or_else(|| panic!("no {name}{labels:?} in:\n{}", self.text))
    }

    /// The sum over every series of `name` whose labels include `with`.
    fn sum(&self, name: &str, with: &[(&str, &str)]) -> f64 {
        self.values
            .iter()
            .filter(|((n, l), _)| {
                n == name
                    && with
                        .iter()
                        .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, v)| v)
            .sum()
    }

    fn has_series_starting(&self, prefix: &str) -> bool {
        self.values.keys().any(|(n, _)| n.starts_with(prefix))
    }
}

fn valid_name(n: &str) -> bool {
    let mut c = n.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
}

fn valid_label_name(n: &str) -> bool {
    let mut c = n.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_')
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        // Rust would also take "inf" or "infinity": the format does not.
        v if v
            .bytes()
            .all(|b| b.is_ascii_digit() || b"+-.eE".contains(&b)) =>
        {
            v.parse().ok()
        }
        _ => None,
    }
}

/// `name{k="v",...} value`, the label values unescaped.
fn parse_sample(line: &str) -> (String, Vec<(String, String)>, f64) {
    let end = line.find(['{', ' ']).expect(line);
    let name = &line[..end];
    assert!(valid_name(name), "{line}");
    let mut labels = Vec::new();
    let mut rest = &line[end..];
    if let Some(mut l) = rest.strip_prefix('{') {
        loop {
            if let Some(after) = l.strip_prefix('}') {
                rest = after;
                break;
            }
            let (k, after) = l.split_once("=\"").expect(line);
            assert!(valid_label_name(k), "label name {k:?}: {line}");
            let mut value = String::new();
            let mut chars = after.char_indices();
            let close = loop {
                match chars.next().expect(line) {
                    (i, '"') => break i,
                    (_, '\\') => match chars.next().expect(line).1 {
                        '\\' => value.push('\\'),
                        '"' => value.push('"'),
                        'n' => value.push('\n'),
                        c => panic!("bad escape \\{c}: {line}"),
                    },
                    (_, '\n') => panic!("raw newline: {line}"),
                    (_, c) => value.push(c),
                }
            };
            labels.push((k.to_string(), value));
            l = &after[close + 1..];
            l = l.strip_prefix(',').unwrap_or(l);
        }
    }
    let value = rest.strip_prefix(' ').expect(line);
    assert!(
        !value.contains(' '),
        "a timestamp or junk after the value: {line}"
    );
    let value = parse_value(value).unwrap_or_else(|| panic!("not a number: {line}"));
    (name.to_string(), labels, value)
}

/// The family a sample belongs to: its own name, or a histogram's or summary's name for its
/// `_bucket`, `_sum` and `_count` series.
fn family_of(name: &str, types: &HashMap<String, String>) -> Option<String> {
    if types.contains_key(name) {
        return Some(name.to_string());
    }
    ["_bucket", "_sum", "_count"].iter().find_map(|s| {
        let base = name.strip_suffix(s)?;
        matches!(types.get(base)?.as_str(), "histogram" | "summary").then(|| base.to_string())
    })
}

fn session(url: &str, queues: u16) -> Session {
    let opts = ConnectOptions {
        queues,
        depth: 8,
        max_io: 256 << 10,
        ..Default::default()
    };
    connect(&Url::parse(url).unwrap(), &opts).expect("connect")
}

/// What one queue did, to compare with what the target counted.
#[derive(Default, Debug, Clone, Copy, PartialEq)]
struct Done {
    reads: u64,
    writes: u64,
    flushes: u64,
    bytes_read: u64,
    bytes_written: u64,
}

/// Known I/O on two queues, then the scrape: per queue and per export, every count the
/// target shows equals what was done, histograms count every request, and the format passes
/// our checks and promtool's. The export's totals keep what the session did after it closes,
/// and `blkwire cp` adds exactly the bytes it copied.
#[test]
fn a_scrape_counts_the_io_done_in_a_valid_exposition() {
    // Export names are the operator's words: quotes and backslashes must be escaped in label
    // values (control characters are refused in names).
    let idle_name = "id\"le\\x";
    let exports = [
        "disk=mem:64M",
        &format!("{idle_name}=mem:1M"),
        "async=memthread:16M",
    ];
    let (t, udp, metrics) = start(&exports);
    let mut s = session(&t.url("disk"), 2);
    let mut done = [Done::default(); 2];
    let mut offset = 0u64;
    for (qi, (q, d)) in s.queues.iter_mut().zip(&mut done).enumerate() {
        let sizes: &[usize] = if qi == 0 {
            &[4096, 4096, 65536, 4096, 8192, 4096, 4096]
        } else {
            &[8192, 8192, 131072]
        };
        for (i, &len) in sizes.iter().enumerate() {
            let data = random_bytes(len, (qi * 100 + i) as u64);
            q.write_at(&data, offset, false).unwrap();
            d.writes += 1;
            d.bytes_written += len as u64;
            for _ in 0..=qi {
                let mut back = vec![0u8; len];
                q.read_at(&mut back, offset).unwrap();
                assert!(back == data, "queue {qi}: read back");
                d.reads += 1;
                d.bytes_read += len as u64;
            }
            offset += len as u64;
        }
        q.flush().unwrap();
        d.flushes += 1;
    }
    let (_, text) = curl(&metrics);
    promtool_check(&text);
    let m = Samples::parse(&text);
    assert_eq!(m.value("blkwire_sessions", &[]), 1.0);
    let sessions = m.sum("blkwire_session_info", &[("export", "disk")]);
    assert_eq!(sessions, 1.0, "one session on disk");
    let mut seen_threads = HashSet::new();
    for (qi, d) in done.iter().enumerate() {
        let queue = qi.to_string();
        let q = [("export", "disk"), ("queue", queue.as_str())];
        let op = |name: &str, op: &str| {
            let mut l = q.to_vec();
            l.push(("op", op));
            m.sum(name, &l)
        };
        assert_eq!(
            op("blkwire_queue_requests_total", "read"),
            d.reads as f64,
            "queue {qi}"
        );
        assert_eq!(
            op("blkwire_queue_requests_total", "write"),
            d.writes as f64,
            "queue {qi}"
        );
        assert_eq!(
            op("blkwire_queue_requests_total", "flush"),
            d.flushes as f64,
            "queue {qi}"
        );
        assert_eq!(
            op("blkwire_queue_requests_total", "trim"),
            0.0,
            "queue {qi}"
        );
        let latency = "blkwire_queue_request_duration_seconds_count";
        assert_eq!(
            op(latency, "read"),
            d.reads as f64,
            "queue {qi}: every read timed"
        );
        assert_eq!(
            op(latency, "write"),
            d.writes as f64,
            "queue {qi}: every write timed"
        );
        let sum = op("blkwire_queue_request_duration_seconds_sum", "read");
        assert!(sum > 0.0, "queue {qi}: reads took some time");
        assert_eq!(
            m.sum("blkwire_queue_read_bytes_total", &q),
            d.bytes_read as f64
        );
        assert_eq!(
            m.sum("blkwire_queue_written_bytes_total", &q),
            d.bytes_written as f64
        );
        assert_eq!(m.sum("blkwire_queue_errors_total", &q), 0.0);
        assert_eq!(
            m.sum("blkwire_queue_in_flight", &q),
            0.0,
            "everything answered"
        );
        let answered = m.sum("blkwire_queue_frames_out_total", &q);
        assert!(
            answered >= (d.reads + d.writes + d.flushes) as f64,
            "queue {qi}: {answered}"
        );
        let thread = m
            .values
            .keys()
            .find(|(n, l)| {
                n == "blkwire_queue_in_flight" && l.contains(&("queue".into(), queue.clone()))
            })
            .and_then(|(_, l)| l.iter().find(|(k, _)| k == "thread"))
            .map(|(_, v)| v.clone())
            .expect("a thread label");
        seen_threads.insert(thread);
    }
    assert_eq!(
        seen_threads.len(),
        2,
        "the two queues run on the two reactors"
    );
    let total: Done = done.iter().fold(Done::default(), |a, d| Done {
        reads: a.reads + d.reads,
        writes: a.writes + d.writes,
        flushes: a.flushes + d.flushes,
        bytes_read: a.bytes_read + d.bytes_read,
        bytes_written: a.bytes_written + d.bytes_written,
    });
    let export = |m: &Samples, name: &str, op: Option<&str>| {
        let mut l = vec![("export", "disk")];
        l.extend(op.map(|o| ("op", o)));
        m.value(name, &l)
    };
    let requests = "blkwire_export_requests_total";
    let check_export = |m: &Samples, when: &str| {
        assert_eq!(
            export(m, requests, Some("read")),
            total.reads as f64,
            "{when}"
        );
        assert_eq!(
            export(m, requests, Some("write")),
            total.writes as f64,
            "{when}"
        );
        assert_eq!(
            export(m, "blkwire_export_read_bytes_total", None),
            total.bytes_read as f64,
            "{when}"
        );
        assert_eq!(
            export(m, "blkwire_export_written_bytes_total", None),
            total.bytes_written as f64,
            "{when}"
        );
        let count = "blkwire_export_request_duration_seconds_count";
        assert_eq!(export(m, count, Some("read")), total.reads as f64, "{when}");
    };
    check_export(&m, "session open");
    async_and_datagram_requests_are_timed(&t.url("async"), &format!("{udp}/async"), &metrics);
    let idle = [("export", idle_name), ("op", "read")];
    assert_eq!(
        m.value(requests, &idle),
        0.0,
        "an export never used has its series"
    );
    let idle_latency = "blkwire_export_request_duration_seconds_count";
    assert_eq!(m.value(idle_latency, &idle), 0.0);

    // Closed queues stay in their export's totals: the same numbers whether the target has
    // closed the queues yet or not (each reactor reports closed and live ones at once).
    drop(s);
    check_export(&scrape(&metrics), "session closing");
    // Until the target has closed both queues (a scrape does not wait for that).
    let deadline = Instant::now() + Duration::from_secs(20);
    let after = loop {
        let m = scrape(&metrics);
        if m.value("blkwire_sessions", &[]) == 0.0 && !m.has_series_starting("blkwire_queue_") {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "the session never closed:\n{}",
            m.text
        );
    };
    check_export(&after, "session closed");
    assert_eq!(after.sum("blkwire_session_info", &[]), 0.0);

    // The CLI's copy adds exactly what it wrote.
    let d = TempDir::new("metrics");
    let file = d.path("in.img");
    std::fs::write(&file, random_bytes(1 << 20, 5)).unwrap();
    let (ok, _, err) = cli(&["cp", file.to_str().unwrap(), &t.url("disk")]);
    assert!(ok, "{err}");
    let m = scrape(&metrics);
    let written = export(&m, "blkwire_export_written_bytes_total", None);
    assert_eq!(written, (total.bytes_written + (1 << 20)) as f64);
    promtool_check(&m.text);
}

/// A backend that answers on its own thread (requests wait in their slots for the result)
/// over TCP, then over UDP (the datagram slots): every request is timed.
fn async_and_datagram_requests_are_timed(tcp: &str, udp: &str, metrics: &str) {
    let mut ops = 0;
    for url in [tcp, udp] {
        let mut s = session(url, 1);
        let q = &mut s.queues[0];
        for i in 0..3u64 {
            q.write_at(&[i as u8; 8192], i * 8192, false).unwrap();
            let mut back = [0u8; 8192];
            q.read_at(&mut back, i * 8192).unwrap();
            assert!(back.iter().all(|b| *b == i as u8), "{url}: read back");
        }
        ops += 3;
        let m = scrape(metrics);
        for op in ["read", "write"] {
            let l = [("export", "async"), ("op", op)];
            let timed = m.value("blkwire_export_request_duration_seconds_count", &l);
            assert_eq!(timed, ops as f64, "{url}: {op}s timed");
            assert_eq!(
                m.value("blkwire_export_requests_total", &l),
                ops as f64,
                "{url}"
            );
        }
    }
}

/// `ADDR:PORT` of the metrics URL `http://ADDR:PORT/metrics`.
fn endpoint_addr(metrics: &str) -> String {
    metrics
        .strip_prefix("http://")
        .and_then(|a| a.strip_suffix("/metrics"))
        .unwrap()
        .to_string()
}

/// Sends `request` on a new connection to the endpoint and returns all it answered.
fn exchange(addr: &str, request: &[u8]) -> String {
    let mut c = TcpStream::connect(addr).unwrap();
    // A guard against a hang, not a measurement: the target answers within its 2 s deadline.
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    c.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    // The target may answer and close before taking every byte of a hostile request.
    let _ = c.write_all(request);
    let mut answer = Vec::new();
    let _ = c.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

/// Garbage, a head larger than the endpoint reads, a flood, wrong methods, paths and
/// versions, and clients that say nothing: each is answered (or cut off) and the next scrape
/// works; the target serves I/O throughout and stops cleanly.
#[test]
fn hostile_http_clients_neither_hang_nor_crash_the_target() {
    let (mut t, _, metrics) = start(&["m=mem:16M"]);
    let addr = endpoint_addr(&metrics);
    let status = |answer: &str| answer.lines().next().unwrap_or("").to_string();
    let cases: &[(&[u8], &str)] = &[
        (
            b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03garbage\r\n\r\n",
            "HTTP/1.1 400 ",
        ),
        (b"GET / HTTP/1.1\r\n\r\n", "HTTP/1.1 404 "),
        (b"DELETE /metrics HTTP/1.1\r\n\r\n", "HTTP/1.1 405 "),
        (b"GET /metrics HTTP/3.0\r\n\r\n", "HTTP/1.1 505 "),
        (b"GET /metrics HTTP/1.1\r\n\r\n", "HTTP/1.1 200 "),
    ];
    for (request, want) in cases {
        let answer = exchange(&addr, request);
        assert!(
            status(&answer).starts_with(want),
            "{:?}: {answer}",
            String::from_utf8_lossy(request)
        );
        assert!(answer.contains("\r\nConnection: close\r\n"), "{answer}");
    }
    let not_allowed = exchange(&addr, b"POST /metrics HTTP/1.1\r\n\r\n");
    assert!(not_allowed.contains("\r\nAllow: GET\r\n"), "{not_allowed}");

    // A head that never ends: 431 once 8 KiB are in, whatever more is sent.
    let mut huge = b"GET /metrics HTTP/1.1\r\nX-Padding: ".to_vec();
    huge.resize(9000, b'a');
    assert!(status(&exchange(&addr, &huge)).starts_with("HTTP/1.1 431 "));
    let mut flood = huge.clone();
    flood.resize(4 << 20, b'a');
    let answer = exchange(&addr, &flood);
    assert!(
        answer.is_empty() || status(&answer).starts_with("HTTP/1.1 431 "),
        "{answer}"
    );

    // Clients that say nothing, or half a request line: the scrape waiting behind them is
    // served once their deadline cuts them off (408), and so is an I/O client meanwhile.
    let mut silent = TcpStream::connect(&addr).unwrap();
    let mut trickle = TcpStream::connect(&addr).unwrap();
    trickle.write_all(b"GET /metr").unwrap();
    let m = scrape(&metrics);
    assert_eq!(m.value("blkwire_sessions", &[]), 0.0);
    let (ok, out, err) = cli(&["info", &t.url("m")]);
    assert!(ok && out.contains("16"), "{out}{err}");
    for c in [&mut silent, &mut trickle] {
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut answer = String::new();
        let _ = c.read_to_string(&mut answer);
        assert!(status(&answer).starts_with("HTTP/1.1 408 "), "{answer}");
    }

    let (code, body) = curl(&metrics);
    assert_eq!(code, 200);
    promtool_check(&body);
    assert!(
        t.child.try_wait().unwrap().is_none(),
        "the target is still running"
    );
    // The endpoint's thread does not hold the target up when it stops.
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(t.pid(), libc::SIGTERM) }, 0);
    let exit = t.child.wait().unwrap();
    assert!(exit.success(), "exit status after SIGTERM: {exit:?}");
}

/// Slow clients hold a place of the endpoint each, for at most their deadline, not the
/// endpoint: with three of them connected and silent (one at a time, the scrape would wait for
/// the 2 s deadline of each, 6 s), a scrape is served at once, and they still get their 408.
#[test]
fn a_scrape_is_served_while_slow_clients_wait_for_their_deadline() {
    let (_t, _, metrics) = start(&["m=mem:1M"]);
    let addr = endpoint_addr(&metrics);
    let mut slow: Vec<TcpStream> = (0..3)
        .map(|i| {
            let mut c = TcpStream::connect(&addr).unwrap();
            if i == 1 {
                c.write_all(b"GET /metr").unwrap();
            }
            c
        })
        .collect();
    // They are ahead of the scrape in the listener's queue. Served in turn, the scrape would
    // be answered only after each of them got its 408 at its 2 s deadline: when its answer
    // comes, none of them may have had one yet.
    let m = scrape(&metrics);
    assert_eq!(m.value("blkwire_sessions", &[]), 0.0);
    for c in &mut slow {
        c.set_nonblocking(true).unwrap();
        let mut b = [0u8; 1];
        match c.read(&mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("a slow client was answered before the scrape: {other:?}"),
        }
        c.set_nonblocking(false).unwrap();
    }
    for c in &mut slow {
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut answer = String::new();
        let _ = c.read_to_string(&mut answer);
        assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    }
}

/// An export removed and added again under its name counts from zero, as METRICS.md says:
/// not from the old export's totals, nor held at the last value reported.
#[test]
fn an_export_added_again_counts_from_zero() {
    let dir = TempDir::new("metrics-readd");
    let t = common::Controlled::start(
        &dir,
        &[
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            "x=mem:1M",
            "--threads",
            "1",
        ],
    );
    let metrics = t.rpc("metrics_listen", r#"{"addr": "127.0.0.1:0"}"#);
    let metrics = metrics["url"].as_str().unwrap_or_default().to_string();
    assert!(metrics.starts_with("http://"), "{metrics}");
    let url = format!("{}/x", t.urls[0]);
    let reads = |n: usize| {
        let mut s = session(&url, 1);
        let mut buf = [0u8; 4096];
        for _ in 0..n {
            s.queues[0].read_at(&mut buf, 0).unwrap();
        }
    };
    let read_total = |m: &Samples| {
        m.value(
            "blkwire_export_requests_total",
            &[("export", "x"), ("op", "read")],
        )
    };
    reads(5);
    assert_eq!(read_total(&scrape(&metrics)), 5.0);
    t.rpc("export_remove", r#"{"name": "x", "force": true}"#);
    t.rpc("export_add", r#"{"name": "x", "spec": "mem:1M"}"#);
    reads(2);
    assert_eq!(read_total(&scrape(&metrics)), 2.0, "from zero");
}

/// Clients that say nothing cannot keep a scrape waiting, however many connect: a scrape
/// behind a hundred of them (served four at a time, it waited for the 2 s deadline of each,
/// about 50 s) is answered while the newest of them still wait for theirs, unanswered; the
/// oldest were closed, unanswered, to make room (one address holds at most 16 places).
#[test]
fn a_crowd_of_silent_clients_does_not_keep_a_scrape_waiting() {
    let (_t, _, metrics) = start(&["m=mem:1M"]);
    let addr = endpoint_addr(&metrics);
    let mut silent: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    let m = scrape(&metrics);
    assert_eq!(m.value("blkwire_sessions", &[]), 0.0);
    let newest = silent.last_mut().unwrap();
    newest.set_nonblocking(true).unwrap();
    let waiting = newest.read(&mut [0u8; 64]);
    assert!(
        matches!(&waiting, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the newest silent client is no longer waiting: {waiting:?}"
    );
    // A guard against a hang, not a measurement: the oldest was closed long ago.
    let oldest = &mut silent[0];
    oldest
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut answer = Vec::new();
    let _ = oldest.read_to_end(&mut answer);
    assert!(
        answer.is_empty(),
        "the oldest got an answer: {}",
        String::from_utf8_lossy(&answer)
    );
}

#[test]
fn bad_metrics_addresses_get_one_line_errors() {
    let serve = |metrics: &str| {
        let base = [
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            "x=mem:1M",
        ];
        let mut args: Vec<String> = base.iter().map(|a| a.to_string()).collect();
        args.extend(["--metrics".to_string(), metrics.to_string()]);
        args
    };
    for bad in [
        "nonsense",
        "127.0.0.1",
        "127.0.0.1:99999",
        "http://127.0.0.1:9100",
    ] {
        let a = serve(bad);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        assert_one_line_error(&a, "bad metrics address");
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let a = serve(&taken);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    assert_one_line_error(&a, "cannot serve metrics on");
}
