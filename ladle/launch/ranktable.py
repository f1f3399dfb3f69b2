"""HCCL's rank table (`rank_table.json`, version 1.0): which NPU of which server is which rank,
and the IP each NPU's HCCL traffic uses. Ascend jobs started without a rendezvous read it through
`RANK_TABLE_FILE`.

    {"version": "1.0", "server_count": "2", "status": "completed",
     "server_list": [{"server_id": "10.0.0.1", "host_nic_ip": "reserve",
                      "device": [{"device_id": "0", "device_ip": "192.168.1.10", "rank_id": "0"}, ...]},
                     ...]}

Every value is a string; ranks count up over servers in order, then devices. `write` builds one
from the servers and their devices' IPs (a hosts file and a device-IP file, or `hccn_tool` on
this node); `check` names every problem of one: duplicate ranks, a server missing devices, two
devices on one IP, a malformed IP.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

from ladle.errors import ConfigError

VERSION = "1.0"


def read_hosts(path: str | os.PathLike) -> list[str]:
    """Server IPs, one a line (`# comments`, blank lines and `slots=N` after the IP ignored)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host = line.split()[0]
        if not _is_ip(host):
            raise ConfigError(
                f"{path}:{n}: {host!r} is not an IP address; the rank table needs each server's IP"
            )
        out.append(host)
    if not out:
        raise ConfigError(f"{path}: no servers listed")
    return out


def read_device_ips(path: str | os.PathLike) -> dict[str, dict[int, str]]:
    """`SERVER_IP DEVICE_ID DEVICE_IP` a line -> {server: {device: ip}}."""
    out: dict[str, dict[int, str]] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3 or not parts[1].isdigit() or not (_is_ip(parts[0]) and _is_ip(parts[2])):
            raise ConfigError(f"{path}:{n}: expected 'SERVER_IP DEVICE_ID DEVICE_IP', got {line!r}")
        server, device, ip = parts[0], int(parts[1]), parts[2]
        if device in out.setdefault(server, {}):
            raise ConfigError(f"{path}:{n}: device {device} of server {server} is listed twice")
        out[server][device] = ip
    return out


def parse_hccn_ip(text: str) -> str | None:
    """The address in `hccn_tool -i N -ip -g`'s output (`ipaddr:192.168.1.10`)."""
    m = re.search(r"ipaddr\s*:\s*(\S+)", text)
    return m.group(1) if m and _is_ip(m.group(1)) else None


def local_device_ips(devices: int) -> dict[int, str]:
    """This node's NPU IPs from `hccn_tool` (the NPU driver's tool)."""
    out = {}
    for d in range(devices):
        try:
            r = subprocess.run(
                ["hccn_tool", "-i", str(d), "-ip", "-g"], capture_output=True, text=True, timeout=20
            )
        except (OSError, subprocess.SubprocessError) as e:
            raise ConfigError(
                f"cannot run hccn_tool for device {d} ({e}); is the Ascend driver installed?"
            ) from None
        ip = parse_hccn_ip(r.stdout)
        if r.returncode or ip is None:
            raise ConfigError(
                f"hccn_tool -i {d} -ip -g gave no address: {(r.stdout + r.stderr).strip()[:200]}"
            )
        out[d] = ip
    return out


def build(servers: list[str], ips: dict[str, dict[int, str]], devices_per_node: int) -> dict:
    """The table of `servers` in order, each with devices 0..devices_per_node-1."""
    table = {"version": VERSION, "server_count": str(len(servers)), "server_list": [], "status": "completed"}
    rank = 0
    for server in servers:
        have = ips.get(server, {})
        missing = [d for d in range(devices_per_node) if d not in have]
        if missing:
            raise ConfigError(f"server {server}: no IP for device{'s' * (len(missing) > 1)} {missing}")
        devices = []
        for d in range(devices_per_node):
            devices.append({"device_id": str(d), "device_ip": have[d], "rank_id": str(rank)})
            rank += 1
        table["server_list"].append({"server_id": server, "device": devices, "host_nic_ip": "reserve"})
    problems = check(table)
    if problems:
        raise ConfigError("the rank table would be invalid: " + "; ".join(problems))
    return table


def check(table: dict) -> list[str]:
    """Every problem of a rank table (an empty list: it is valid)."""
    if not isinstance(table, dict):
        return ["the top level is not a JSON object"]
    problems = []
    if table.get("version") != VERSION:
        problems.append(f"version is {table.get('version')!r}, expected {VERSION!r}")
    servers = table.get("server_list")
    if not isinstance(servers, list) or not servers:
        return [*problems, "server_list is missing or empty"]
    if str(table.get("server_count")) != str(len(servers)):
        problems.append(f"server_count is {table.get('server_count')!r} but server_list holds {len(servers)}")
    if table.get("status") != "completed":
        problems.append(f"status is {table.get('status')!r}, expected 'completed'")
    ranks, ips, ids = Counter(), Counter(), Counter()
    counts = {}
    for s in servers:
        sid = s.get("server_id") if isinstance(s, dict) else None
        if not isinstance(sid, str) or not _is_ip(sid):
            problems.append(f"server_id {sid!r} is not an IP address")
        ids[sid] += 1
        devices = s.get("device") if isinstance(s, dict) else None
        if not isinstance(devices, list) or not devices:
            problems.append(f"server {sid}: no devices")
            continue
        counts[sid] = len(devices)
        seen = Counter()
        for d in devices:
            if not isinstance(d, dict) or not {"device_id", "device_ip", "rank_id"} <= d.keys():
                problems.append(f"server {sid}: a device lacks device_id, device_ip or rank_id: {d!r}")
                continue
            if not str(d["rank_id"]).isdigit() or not str(d["device_id"]).isdigit():
                problems.append(f"server {sid}: device {d['device_id']!r} has rank_id {d['rank_id']!r}")
                continue
            if not _is_ip(str(d["device_ip"])):
                problems.append(
                    f"server {sid}: device {d['device_id']} has device_ip {d['device_ip']!r}, not an IP"
                )
            seen[int(d["device_id"])] += 1
            ranks[int(d["rank_id"])] += 1
            ips[str(d["device_ip"])] += 1
        problems += [f"server {sid}: device {k} listed {n} times" for k, n in sorted(seen.items()) if n > 1]
        gaps = [k for k in range(max(seen, default=-1) + 1) if k not in seen]
        if gaps:
            problems.append(f"server {sid}: devices {gaps} are missing (device ids run 0..{max(seen)})")
    problems += [f"server_id {k} listed {n} times" for k, n in ids.items() if n > 1 and k is not None]
    problems += [f"rank {k} is given to {n} devices" for k, n in sorted(ranks.items()) if n > 1]
    missing = [k for k in range(len(ranks) and max(ranks) + 1) if k not in ranks]
    if missing:
        problems.append(f"ranks {missing[:16]} are given to no device (ranks must run 0..{max(ranks)})")
    problems += [f"device_ip {k} is used by {n} devices" for k, n in sorted(ips.items()) if n > 1]
    if len(set(counts.values())) > 1:
        most = Counter(counts.values()).most_common(1)[0][0]
        short = [f"{k} ({v})" for k, v in counts.items() if v != most]
        problems.append(f"servers with another device count than the others' {most}: {', '.join(short)}")
    return problems


def load(path: str | os.PathLike) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path}: not a readable JSON rank table ({e})") from None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
