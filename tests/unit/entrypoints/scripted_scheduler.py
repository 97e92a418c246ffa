"""A scripted stand-in for the scheduler process, for fast unit tests of the HTTP layer.

It speaks the real ZMQ + io_struct protocol from a thread: every request
"generates" the bytes of ``SCRIPT`` one byte-token at a time (``ByteTokenizer``
ids are bytes), honouring max_new_tokens, stop_token_ids and aborts. It is
only a test double; the integration tests run the real engine.
"""

from __future__ import annotations

import threading

import zmq

from fleetserve.engine.io_frames import decode, encode
from fleetserve.engine.io_struct import (
    AbortReq,
    BatchTokenOut,
    FlushCacheOut,
    FlushCacheReq,
    GetStatsReq,
    ReqOutput,
    SchedulerStats,
    TokenizedGenerateReq,
)

SCRIPT = "Hello 你好😀 world STOP more text here".encode("utf-8")
EOS = 256


class ByteTokenizer:
    """ids 0..255 are bytes, 256 is EOS (special); a trivial chat template."""

    chat_template = "role: content"
    eos_token_id = EOS

    def __len__(self):
        return 257

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        out = b"".join(b"<eos>" if i == EOS else bytes([i]) for i in ids if not (skip_special_tokens and i == EOS))
        return out.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, i):
        return None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, continue_final_message=False,
                            **kw):
        for m in messages:
            if m["content"] == "<reject>":
                raise ValueError("the template refuses this message")
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


class ScriptedScheduler:
    def __init__(self, input_ep: str, output_ep: str, delay: float = 0.0):
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(input_ep)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(output_ep)
        self.delay = delay
        self.running: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.received: list[TokenizedGenerateReq] = []
        self.flushes = 0
        self.seen_prompts: list[list[int]] = []
        self._stop = threading.Event()
        self.run_steps = threading.Event()  # cleared: no request makes progress (a long prefill)
        self.run_steps.set()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def close(self):
        self._stop.set()
        self.thread.join(5)
        self.pull.close(0)
        self.push.close(0)
        self.ctx.term()

    def _cached(self, ids):
        best = 0
        for p in self.seen_prompts:
            k = 0
            while k < min(len(p), len(ids)) and p[k] == ids[k]:
                k += 1
            best = max(best, k)
        return best

    def _out(self, st, new, finished, reason):
        r = st["req"]
        lps = [(-0.5, t) for t in new] if r.return_logprob else None
        tops = [[(-0.5, t), (-1.5, 0)][: r.top_logprobs_num] for t in new] if r.return_logprob else None
        first = not st["sent_input"]
        st["sent_input"] = True
        inp = None
        if r.return_logprob and r.logprob_start_len == 0 and first:
            inp = [(None if i == 0 else -1.0, t) for i, t in enumerate(r.input_ids)]
        return ReqOutput(r.rid, list(new), finished, reason, len(r.input_ids), st["n"], st["cached"],
                         output_logprobs=lps, output_top_logprobs=tops, input_logprobs=inp)

    def _loop(self):
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while not self._stop.is_set():
            if dict(poller.poll(5)):
                while True:
                    try:
                        msg = decode(self.pull.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    self._handle(msg)
            outs = []
            for rid, st in list(self.running.items()) if self.run_steps.is_set() else ():
                r = st["req"]
                mx = r.sampling.max_new_tokens
                if st["n"] >= mx or st["n"] >= len(SCRIPT):
                    del self.running[rid]
                    outs.append(self._out(st, [], True, {"type": "length", "length": st["n"]}))
                    continue
                tok = SCRIPT[st["n"]]
                st["n"] += 1
                if tok in r.sampling.stop_token_ids:
                    del self.running[rid]
                    outs.append(self._out(st, [tok], True, {"type": "stop", "matched": tok}))
                    continue
                done = st["n"] >= mx
                if done:
                    del self.running[rid]
                outs.append(self._out(st, [tok], done, {"type": "length", "length": st["n"]} if done else None))
            if outs:
                self.push.send_multipart(encode(BatchTokenOut(outs)))
                if self.delay:
                    self._stop.wait(self.delay)

    def _handle(self, msg):
        if isinstance(msg, TokenizedGenerateReq):
            self.received.append(msg)
            st = {"req": msg, "n": 0, "cached": self._cached(msg.input_ids), "sent_input": False}
            self.seen_prompts.append(list(msg.input_ids))
            if msg.sampling.max_new_tokens == 0:
                self.push.send_multipart(encode(BatchTokenOut([self._out(st, [], True, {"type": "length", "length": 0})])))
            else:
                self.running[msg.rid] = st
        elif isinstance(msg, AbortReq):
            self.aborted.append(msg.rid)
            st = self.running.pop(msg.rid, None)
            if st is not None:
                self.push.send_multipart(encode(BatchTokenOut([self._out(st, [], True, {"type": "abort", "message": "aborted"})])))
        elif isinstance(msg, FlushCacheReq):
            self.flushes += 1
            ok = not self.running
            if ok:
                self.seen_prompts.clear()
            self.push.send_multipart(encode(FlushCacheOut(ok)))
        elif isinstance(msg, GetStatsReq):
            self.push.send_multipart(encode(SchedulerStats(num_running_reqs=len(self.running), kv_pool_size=1000,
                                                       kv_used_tokens=sum(len(s["req"].input_ids) + s["n"]
                                                                          for s in self.running.values()))))
