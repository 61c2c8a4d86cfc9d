"""What a program body and its caller hold: `ProgramState` (one executor's handle) and `ProgramStateGroup`
(the branches of a fork). Every method submits IR nodes to, or reads results from, the state's
`StreamExecutor` (frontend_lang/interpreter.py); nothing here runs a backend call itself.
"""

from __future__ import annotations

import contextlib
from typing import Any

from frontend_lang import ir
from frontend_lang.interpreter import StreamExecutor


class ProgramState:
    """What a program body and its caller hold: `s += ...`, `s["x"]`, roles, forks, results."""

    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None

    def _role(self, role: str, expr: Any = None) -> Any:
        if expr is not None:
            self.stream_executor.submit(ir.ExprList([ir.RoleBegin(role), ir.as_expr(expr), ir.RoleEnd(role)]))
            return None

        @contextlib.contextmanager
        def scope():
            self.stream_executor.submit(ir.RoleBegin(role))
            yield
            self.stream_executor.submit(ir.RoleEnd(role))

        return scope()

    def system(self, expr: Any = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str):
        self.stream_executor.submit(ir.VarScopeBegin(name))
        yield
        self.stream_executor.submit(ir.VarScopeEnd(name))

    def fork(self, size: int = 1) -> ProgramStateGroup:
        return ProgramStateGroup([ProgramState(e) for e in self.stream_executor.fork(size)], self)

    @contextlib.contextmanager
    def copy(self):
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    def text(self) -> str:
        self.stream_executor.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict]:
        self.stream_executor.sync()
        return self.stream_executor.messages_

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        self.stream_executor.sync()
        return self.stream_executor.error_

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        return self.stream_executor.get_meta_info(name)

    def text_iter(self, var_name: str | None = None):
        from frontend_lang.streaming import text_iter
        return text_iter(self.stream_executor, var_name)

    def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False):
        from frontend_lang.streaming import text_async_iter
        return text_async_iter(self.stream_executor, var_name, return_meta_data)

    def __iadd__(self, other: Any) -> ProgramState:
        if other is None:
            raise ValueError("cannot append None to a program state")
        self.stream_executor.submit(other)
        return self

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The branches of `s.fork(n)`. `join()` gathers each branch's new variables into lists on the parent."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState) -> None:
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        if mode != "gather_variable":
            raise ValueError(f"join mode {mode!r} is not supported (only 'gather_variable')")
        src = self.src_state.stream_executor
        before = set(src.variables)
        for st in self.states:
            child = st.stream_executor
            child.sync()
            for k in child.variables.keys() - before:
                src.variables.setdefault(k, []).append(child.variables[k])
            if child.error_ is not None and src.error_ is None:
                src.error_ = child.error_
            child.end()

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if callable(other):
            for i, st in enumerate(self.states):
                st += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} items for {len(self.states)} branches")
            for st, item in zip(self.states, other, strict=True):
                st += item
        else:
            for st in self.states:
                st += other
        return self
