"""HCCL's rank table (issue 19, part 6): written from a hosts file and device IPs (or hccn_tool's
output), read back and checked; every kind of damage named by `--check`."""

import copy
import json

import pytest

from ladle.cli import main
from ladle.launch import ranktable


def two_servers(tmp_path, devices=2):
    hosts = tmp_path / "hosts"
    hosts.write_text("# the servers, in rank order\n10.0.0.1 slots=2\n\n10.0.0.2\n")
    ips = tmp_path / "ips"
    ips.write_text("".join(f"10.0.0.{s} {d} 192.168.{s}.{10 + d}\n" for s in (1, 2) for d in range(devices)))
    return hosts, ips


def test_a_table_is_written_and_checks_valid(tmp_path, capsys):
    hosts, ips = two_servers(tmp_path)
    out = tmp_path / "rank_table.json"
    argv = ["rank-table", "--hosts", str(hosts), "--device-ips", str(ips), "--devices-per-node", "2"]
    assert main([*argv, "-o", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table == {
        "version": "1.0",
        "server_count": "2",
        "server_list": [
            {
                "server_id": "10.0.0.1",
                "device": [
                    {"device_id": "0", "device_ip": "192.168.1.10", "rank_id": "0"},
                    {"device_id": "1", "device_ip": "192.168.1.11", "rank_id": "1"},
                ],
                "host_nic_ip": "reserve",
            },
            {
                "server_id": "10.0.0.2",
                "device": [
                    {"device_id": "0", "device_ip": "192.168.2.10", "rank_id": "2"},
                    {"device_id": "1", "device_ip": "192.168.2.11", "rank_id": "3"},
                ],
                "host_nic_ip": "reserve",
            },
        ],
        "status": "completed",
    }
    capsys.readouterr()
    assert main(["rank-table", "--check", str(out)]) == 0
    assert "valid, 2 servers, 4 ranks" in capsys.readouterr().out


def valid(tmp_path) -> dict:
    hosts, ips = two_servers(tmp_path)
    return ranktable.build(ranktable.read_hosts(hosts), ranktable.read_device_ips(ips), 2)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda t: t["server_list"][1]["device"][0].update(rank_id="1"), "rank 1 is given to 2 devices"),
        (lambda t: t["server_list"][1]["device"].pop(0), "server 10.0.0.2: devices [0] are missing"),
        (
            lambda t: t["server_list"][1]["device"][1].update(device_ip="192.168.1.10"),
            "device_ip 192.168.1.10 is used by 2 devices",
        ),
        (lambda t: t.update(version="2.0"), "version is '2.0', expected '1.0'"),
        (lambda t: t.update(server_count="3"), "server_count is '3' but server_list holds 2"),
        (
            lambda t: t["server_list"][0]["device"][0].update(device_ip="192.168.1"),
            "has device_ip '192.168.1', not an IP",
        ),
        (lambda t: t["server_list"][1].update(server_id="10.0.0.1"), "server_id 10.0.0.1 listed 2 times"),
    ],
)
def test_check_names_each_problem(tmp_path, capsys, damage, message):
    table = copy.deepcopy(valid(tmp_path))
    damage(table)
    assert any(message in p for p in ranktable.check(table)), ranktable.check(table)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(table))
    assert main(["rank-table", "--check", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_device_in_one_server_differs_from_the_others(tmp_path):
    table = valid(tmp_path)
    table["server_list"][1]["device"].pop()  # device 1 of the second server
    for i, d in enumerate(d for s in table["server_list"] for d in s["device"]):
        d["rank_id"] = str(i)
    assert ranktable.check(table) == ["servers with another device count than the others' 2: 10.0.0.2 (1)"]


def test_bad_input_files_are_named_by_line(tmp_path, capsys):
    hosts, ips = two_servers(tmp_path)
    ips.write_text("10.0.0.1 0 192.168.1.10\n10.0.0.1 zero 192.168.1.11\n")
    assert (
        main(["rank-table", "--hosts", str(hosts), "--device-ips", str(ips), "--devices-per-node", "2"]) == 2
    )
    assert f"{ips}:2: expected 'SERVER_IP DEVICE_ID DEVICE_IP'" in capsys.readouterr().err
    ips.write_text("10.0.0.1 0 192.168.1.10\n")
    assert (
        main(["rank-table", "--hosts", str(hosts), "--device-ips", str(ips), "--devices-per-node", "2"]) == 2
    )
    assert "server 10.0.0.1: no IP for device [1]" in capsys.readouterr().err
    hosts.write_text("node-a\n")
    assert main(["rank-table", "--hosts", str(hosts), "--device-ips", str(ips)]) == 2
    assert f"{hosts}:1: 'node-a' is not an IP address" in capsys.readouterr().err
    (tmp_path / "x.json").write_text("{not json")
    assert main(["rank-table", "--check", str(tmp_path / "x.json")]) == 2
    assert "not a readable JSON rank table" in capsys.readouterr().err


def test_hccn_tool_output_is_parsed():
    assert ranktable.parse_hccn_ip("ipaddr:192.168.100.101\nnetmask:255.255.255.0\n") == "192.168.100.101"
    assert ranktable.parse_hccn_ip("ipaddr: \n") is None
