"""`WeightSyncClient`: a trainer's handle on a ringserve (or vLLM) server's weight-sync and
RL-control HTTP routes, on the standard library only.

The routes and bodies are vLLM's: ``POST /init_weight_transfer_engine {"init_info"}``,
``/start_weight_update {"metadata"}``, ``/update_weights {"update_info"}``,
``/finish_weight_update {"weight_version"}``, ``/pause?mode=``, ``/resume``,
``GET /is_paused``, ``/get_world_size?include_dp=``, ``/server_info``,
``POST /collective_rpc {"method", "args", "timeout"}`` and ``GET /health``. It satisfies
`WeightSyncClientProtocol`, so it is what a trainer hands to `TrainerWeightTransferEngine`.
A non-2xx answer raises `WeightSyncError` with the server's error message.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ringserve.weight_transfer.errors import WeightSyncError


class WeightSyncClient:
    """Calls a server's weight-sync routes.

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"``.
        api_key: sent as ``Authorization: Bearer <api_key>`` (the server's ``--api-key``).
        timeout: seconds each request may take (an ``update_weights`` waits for every
            worker to load its bucket).
    """

    def __init__(self, base_url: str, *, api_key: str | None = None,
                 timeout: float = 300.0) -> None:
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"base_url must be an http(s) URL such as http://127.0.0.1:8000, "
                             f"got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                 query: dict[str, str] | None = None) -> Any:
        url = self.base_url + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            with exc:
                text = exc.read().decode(errors="replace")
            raise WeightSyncError(exc.code, _decode(text)) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise WeightSyncError(0, None, f"{method} {url}: {reason}") from exc
        return _decode(raw.decode()) if raw else None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> Any:
        """``POST /init_weight_transfer_engine``: open the channel."""
        return self._request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self, metadata: dict[str, Any] | None = None, *,
                            is_checkpoint_format: bool = True) -> Any:
        """``POST /start_weight_update``: begin a round (`metadata` checked by the engine).

        Args:
            metadata: ``{"names", "dtype_names", "shapes"}`` of the round's tensors.
            is_checkpoint_format: vLLM's flag. True, its default, is what ringserve does with
                every round (checkpoint names and layouts, through the model's loader), so
                it is not sent.

        Raises:
            ValueError: `is_checkpoint_format` False (vLLM's weights already in the
                kernel's layout), or `metadata` not a dict; before any request.
        """
        if is_checkpoint_format is not True:
            raise ValueError("is_checkpoint_format=False (weights already in the engine's "
                             "kernel layout) is not supported: ringserve loads every round "
                             "from checkpoint (Hugging Face) names and layouts through the "
                             "model's loader; send those")
        if metadata is not None and not isinstance(metadata, dict):
            raise ValueError(f"metadata must be a dict {{\"names\", \"dtype_names\", "
                             f"\"shapes\"}} or None, got {metadata!r} (vLLM's "
                             f"is_checkpoint_format goes by keyword)")
        body = None if metadata is None else {"metadata": metadata}
        return self._request("POST", "/start_weight_update", body)

    def update_weights(self, update_info: dict[str, Any]) -> Any:
        """``POST /update_weights``: receive one bucket on every worker."""
        return self._request("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> Any:
        """``POST /finish_weight_update``: serve the round's weights as `weight_version`."""
        return self._request("POST", "/finish_weight_update", {"weight_version": weight_version})

    def pause(self, mode: str = "abort") -> Any:
        """``POST /pause?mode=``: stop generating ("abort", "keep" or "wait")."""
        return self._request("POST", "/pause", query={"mode": mode})

    def resume(self) -> Any:
        """``POST /resume``: undo `pause`."""
        return self._request("POST", "/resume")

    def is_paused(self) -> bool:
        """``GET /is_paused``."""
        return bool(self._field(self._request("GET", "/is_paused"), "is_paused"))

    def get_world_size(self, include_dp: bool = True) -> int:
        """``GET /get_world_size``: the engine's workers (times its data-parallel ranks when
        `include_dp`)."""
        reply = self._request("GET", "/get_world_size",
                              query={"include_dp": "true" if include_dp else "false"})
        return int(self._field(reply, "world_size"))

    def server_info(self) -> dict[str, Any]:
        """``GET /server_info``."""
        reply = self._request("GET", "/server_info")
        if not isinstance(reply, dict):
            raise WeightSyncError(200, reply, f"/server_info: expected a JSON object, got "
                                              f"{reply!r}")
        return reply

    def collective_rpc(self, method: str, args: tuple[Any, ...] | list[Any] = (),
                       timeout: float | None = None) -> list[Any]:
        """``POST /collective_rpc``: an allow-listed worker method on every worker; the
        results in rank order."""
        reply = self._request("POST", "/collective_rpc",
                              {"method": method, "args": list(args), "timeout": timeout})
        results = self._field(reply, "results")
        if not isinstance(results, list):
            raise WeightSyncError(200, reply, f"/collective_rpc: expected a list of results, "
                                              f"got {results!r}")
        return results

    def health(self) -> bool:
        """``GET /health``: True when the server answers 200."""
        try:
            self._request("GET", "/health")
        except WeightSyncError:
            return False
        return True

    @staticmethod
    def _field(reply: Any, key: str) -> Any:
        if not isinstance(reply, dict) or key not in reply:
            raise WeightSyncError(200, reply, f"expected a JSON object with {key!r}, got "
                                              f"{reply!r}")
        return reply[key]


def _decode(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
