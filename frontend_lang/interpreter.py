"""The eager interpreter: one StreamExecutor (worker thread + FIFO queue) per program state.

Data flow: the program body runs on the caller's thread and only *submits* nodes (`s += node`); the
executor's worker thread executes them in order against the backend, appending to `text_`, filling
`variables[name]` and setting `variable_event[name]`. `s["x"]` blocks on that event. A failure stops
execution: the first exception is kept (`error()`), later nodes are drained without running, and every
variable event is released so no reader hangs (reading a variable that was never produced raises).

Invariants: `text_` only grows while the worker runs; a node's output events exist before the node is
queued (so readers never miss them); `queue.join()` (sync) returns once every submitted node is done
or skipped.
The handle a program body holds (`ProgramState`) lives in frontend_lang/program_state.py.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from frontend_lang import ir
from frontend_lang.chat_template import ChatTemplate

logger = logging.getLogger(__name__)


class StreamExecutor:
    def __init__(self, backend: Any, arguments: dict, default_sampling_para: ir.SamplingParams,
                 chat_template: ChatTemplate | None = None, stream: bool = False, use_thread: bool = True) -> None:
        self.backend = backend
        self.arguments = arguments
        self.default_sampling_para = default_sampling_para
        self.chat_template = chat_template or backend.get_chat_template()
        self.stream = stream
        self.use_thread = use_thread

        self.text_ = ""
        self.messages_: list[dict] = []
        self.cur_role: str | None = None
        self.cur_role_begin_pos = 0
        self.cur_images: list[str] = []
        self.fork_start_text_pos = 0
        self.variables: dict[str, Any] = {}
        self.variable_event: dict[str, threading.Event] = {}
        self.meta_info: dict[str, Any] = {}
        self._scope_start: dict[str, int] = {}
        self.error_: BaseException | None = None
        self.is_finished = False
        self._ended = False

        # Streaming: set whenever text (or a variable) grew.
        self.stream_text_event = threading.Event()
        self.stream_var_event: dict[str, threading.Event] = {}

        backend.begin_program(self)
        self.queue: queue.Queue = queue.Queue()
        if use_thread:
            self.worker = threading.Thread(target=self._worker, daemon=True)
            self.worker.start()

    # ------------------------------------------------------------------ submission (caller thread)
    def submit(self, expr: Any) -> None:
        expr = expr if isinstance(expr, ir.Expr) else ir.as_expr(expr)
        self._check_supported(expr)
        for name in ir.output_names(expr):
            self.variable_event[name] = threading.Event()
            if self.stream:
                self.stream_var_event[name] = threading.Event()
        if self.use_thread:
            self.queue.put(expr)
        else:
            self._run_one(expr)

    def _check_supported(self, expr: ir.Expr) -> None:
        items = expr.items if isinstance(expr, ir.ExprList) else [expr]
        if any(isinstance(e, ir.Image) for e in items) and (
                self.chat_template.image_token is None or not self.backend.supports_images):
            raise ValueError(
                f"image() needs a vision-language model, but this backend serves a text-only model "
                f"(chat template {self.chat_template.name!r}); remove the image or use a multimodal model")

    def sync(self) -> None:
        if self.use_thread:
            self.queue.join()

    def end(self) -> None:
        """No more nodes will come: let the worker finish after the queue drains."""
        if self._ended:
            return
        self._ended = True
        if self.use_thread:
            self.queue.put(None)
        else:
            self._finish()
        self.backend.end_program(self)

    # ------------------------------------------------------------------ worker thread
    def _worker(self) -> None:
        while True:
            expr = self.queue.get()
            try:
                if expr is None:
                    break
                self._run_one(expr)
            finally:
                self.queue.task_done()
        self._finish()

    def _run_one(self, expr: ir.Expr) -> None:
        if self.error_ is None:
            try:
                self._execute(expr)
            except Exception as e:  # noqa: BLE001 - any failure of a program node is the program's error
                logger.debug("program node %r failed: %r", expr, e)
                self.error_ = e
        if self.error_ is not None:
            for name in ir.output_names(expr):
                self._release(name)
        if self.stream:
            self.stream_text_event.set()

    def _finish(self) -> None:
        self.is_finished = True
        for name in list(self.variable_event):
            self._release(name)
        self.stream_text_event.set()

    def _release(self, name: str) -> None:
        self.variable_event[name].set()
        if name in self.stream_var_event:
            self.stream_var_event[name].set()

    # ------------------------------------------------------------------ execution
    def _execute(self, expr: ir.Expr) -> None:
        if isinstance(expr, ir.Text):
            self._fill(expr.value)
        elif isinstance(expr, ir.ExprList):
            for e in expr.items:
                self._execute(e)
        elif isinstance(expr, ir.Gen):
            self._execute_gen(expr)
        elif isinstance(expr, ir.Select):
            self._execute_select(expr)
        elif isinstance(expr, ir.RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, ir.RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, ir.VarScopeBegin):
            self._scope_start[expr.name] = len(self.text_)
        elif isinstance(expr, ir.VarScopeEnd):
            self._set_var(expr.name, self.text_[self._scope_start.pop(expr.name):], None)
        elif isinstance(expr, ir.Image):
            self.cur_images.append(expr.path)
            self._fill(self.chat_template.image_token or "")
        elif isinstance(expr, ir.CommitLazy):
            self.backend.commit_lazy_operations(self)
        elif isinstance(expr, ir.SeparateReasoning):
            self._execute_separate_reasoning(expr)
        else:
            raise TypeError(f"unknown program node {expr!r}")

    def _fill(self, text: str) -> None:
        self.text_ += text

    def _set_var(self, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        self.variables[name] = value
        self.meta_info[name] = meta
        self._release(name)

    def resolve_sampling_params(self, params: ir.SamplingParams) -> ir.SamplingParams:
        """Run defaults <- gen's values; dtype becomes a regex; the template's stop strings are added."""
        out = params.merged_over(self.default_sampling_para)
        assert isinstance(out.stop, list)  # merged_over made it a list
        if out.dtype is not None:
            if out.regex is not None:
                logger.warning("gen has both dtype and regex: dtype %s wins", out.dtype)
            out.regex = ir.dtype_regex(out.dtype)
            if out.dtype in ("int", "float"):
                out.stop += [x for x in (" ", "\n") if x not in out.stop]
        out.stop += [x for x in self.chat_template.stop_str if x not in out.stop]
        return out

    def _execute_gen(self, expr: ir.Gen) -> None:
        params = self.resolve_sampling_params(expr.params)
        name = expr.name
        if not self.stream:
            comp, meta = self.backend.generate(self, params)
            self._fill(comp)
            self._set_var(name, ir.convert_dtype(comp, params.dtype), meta)
            return
        # Streaming: the variable grows chunk by chunk; its final event fires at the end.
        acc = ""
        meta = {}
        if name is not None:
            self.variables[name] = ""
        for chunk, meta in self.backend.generate_stream(self, params):
            acc += chunk
            self._fill(chunk)
            if name is not None:
                self.variables[name] = acc
                self.meta_info[name] = meta
                self.stream_var_event[name].set()
            self.stream_text_event.set()
        self._set_var(name, ir.convert_dtype(acc, params.dtype), meta)

    def _execute_separate_reasoning(self, expr: ir.SeparateReasoning) -> None:
        """Split the gen's variable by the server's reasoning parser; the program text keeps the raw output.
        In a streamed run the variable stays whole and the reasoning variable empty (as SGLang's frontend)."""
        if self.stream:
            self._set_var(expr.name, "", None)
            return
        reasoning, content = self.backend.separate_reasoning(self.variables[expr.target], expr.model_type)
        self.variables[expr.target] = content
        self._set_var(expr.name, reasoning, None)

    def _execute_select(self, expr: ir.Select) -> None:
        decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        self._fill(decision.decision)
        self._set_var(expr.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"nested roles are not allowed ({role!r} inside {self.cur_role!r})")
        if not self.messages_ and role != "system" and self.chat_template.default_system_prompt:
            self._role_begin("system")
            self._fill(self.chat_template.default_system_prompt)
            self._role_end("system")
        self.cur_role = role
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._fill(prefix)
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"{role}_end() without a matching {role}_begin()")
        content = self.text_[self.cur_role_begin_pos:].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._fill(suffix)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None

    # ------------------------------------------------------------------ reads (caller thread)
    def get_var(self, name: str) -> Any:
        event = self.variable_event.get(name)
        if event is not None:
            event.wait()
        if name not in self.variables:
            if self.error_ is not None:
                raise RuntimeError(f"variable {name!r} was not produced: the program failed with "
                                   f"{self.error_!r}") from self.error_
            raise KeyError(name)
        return self.variables[name]

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value

    def get_meta_info(self, name: str) -> Any:
        self.get_var(name)
        return self.meta_info.get(name)

    def fork(self, size: int) -> list[StreamExecutor]:
        if size > 1:  # branches share the prefix: have the server cache it once, first
            self.submit(ir.CommitLazy())
        self.sync()
        children = []
        for _ in range(int(size)):
            child = StreamExecutor(self.backend, self.arguments, self.default_sampling_para,
                                   self.chat_template, self.stream, self.use_thread)
            child.text_ = self.text_
            child.messages_ = list(self.messages_)
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
            child.cur_role = self.cur_role
            child.cur_role_begin_pos = self.cur_role_begin_pos
            child.cur_images = list(self.cur_images)
            child.fork_start_text_pos = len(self.text_)
            child.error_ = self.error_
            children.append(child)
        return children
