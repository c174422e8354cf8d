"""Child process for the two-process ring tests (run as a script, not collected by pytest).

Modes (argv[1]):
  consume NAME INDEX COUNT SEED [SLOW]  read COUNT checked frames as reader INDEX
  produce NAME COUNT                    attach as writer and send COUNT frames (forever if -1)
  echo IN OUT POLICY                    read IN, echo every frame to OUT until kind 2
Prints one line "ok k=v ..." on success; exits 3 on PeerDiedError, 4 on RingClosedError.
"""

from __future__ import annotations

import random
import sys
import time
import zlib

from ringserve.shm import PeerDiedError, RingClosedError, RingReader, RingWriter, WaitPolicy

STOP = 2


def payloads(seed: int, n: int = 256, max_len: int = 700) -> list[bytes]:
    """The pool of random payloads both sides derive from ``seed``."""
    rng = random.Random(seed)
    return [rng.randbytes(rng.randrange(0, max_len)) for _ in range(n)]


def consume(name: str, index: int, count: int, seed: int, slow: bool) -> str:
    pool = payloads(seed)
    crcs = [zlib.crc32(p) for p in pool]
    with RingReader.attach(name, index, policy=WaitPolicy(liveness_s=0.05)) as reader:
        seq = 0
        while seq < count:
            frame = reader.recv(20.0)
            data = frame.data
            got = int.from_bytes(data[:8], "little")
            if got != seq or zlib.crc32(data[8:]) != crcs[seq & 255] or frame.kind != seq & 7:
                raise AssertionError(f"reader {index}: bad frame at {seq} (got seq {got})")
            seq += 1
            if seq & 15 == 0:
                reader.release()
                if slow and seq % 2048 == 0:
                    time.sleep(0.002)
        reader.release()
        return f"ok frames={seq} parks={reader.stats.parks}"


def produce(name: str, count: int) -> str:
    with RingWriter.attach(name, policy=WaitPolicy(liveness_s=0.05)) as writer:
        seq = 0
        while seq != count:
            writer.send(seq.to_bytes(8, "little"), kind=1)
            seq += 1
        return f"ok frames={seq}"


def echo(in_name: str, out_name: str, policy_name: str) -> str:
    policy = WaitPolicy.forced_park() if policy_name == "park" else WaitPolicy()
    with (
        RingReader.attach(in_name, policy=policy) as reader,
        RingWriter.attach(out_name, policy=policy) as writer,
    ):
        n = 0
        while True:
            frame = reader.recv(30.0)
            if frame.kind == STOP:
                break
            writer.send(frame.data, frame.kind)
            reader.release()
            n += 1
        rs, ws = reader.stats, writer.stats
        return (
            f"ok echoed={n} parks={rs.parks + ws.parks} "
            f"lost_wakeups={rs.lost_wakeups + ws.lost_wakeups} ticks={rs.ticks + ws.ticks}"
        )


def main(argv: list[str]) -> int:
    mode, args = argv[0], argv[1:]
    try:
        if mode == "consume":
            slow = len(args) > 4 and args[4] == "slow"
            print(consume(args[0], int(args[1]), int(args[2]), int(args[3]), slow))
        elif mode == "produce":
            print(produce(args[0], int(args[1])))
        elif mode == "echo":
            print(echo(args[0], args[1], args[2]))
        else:
            raise SystemExit(f"unknown mode {mode}")
    except PeerDiedError as exc:
        print(f"peer-died {exc}")
        return 3
    except RingClosedError as exc:
        print(f"closed {exc}")
        return 4
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
