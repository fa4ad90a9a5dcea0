"""torch.nn.RNN / GRU / LSTM and their cells on DTensors: torch's recurrent kernels
(`torch.rnn_tanh`, `rnn_relu`, `gru`, `lstm` and the `*_cell` forms, which the modules' own
forward calls with its flat list of weights) written over dtorch ops.

Each kernel reaches dtorch whole through __torch_function__ (dtensor/api.py's TORCH_FUNCTIONS); here it is the
loop torch's CPU kernel runs (aten/src/ATen/native/RNN.cpp), step for step: the input's share of
every step's gates in one linear over the whole sequence, then per step the hidden state's
linear and the gates in torch's order (LSTM i, f, g, o with the projection h = W_hr h; GRU r, z, n
with n = tanh(x_n + r * (W_hn h + b_hn)) and h' = (h - n) * z + n), so values equal torch's to
float rounding and gradients come from dtorch's autograd over these ops. Layers, directions
(the reverse one walks the steps backwards, its outputs concatenated after the forward one's),
batch_first, bias=False, LSTM's proj_size and dropout between layers (dtorch's stream, in
training only) are all handled. Every op is batch-wise, so a batch sharded over dp stays
sharded; nothing is gathered.

The modules' forward makes the default initial state with torch.zeros in this process; it is
made on the workers instead (dtorch.zeros, its batch laid out like the input's), so nothing is
uploaded and strict mode holds. PackedSequence input is refused: pad the batch instead.
"""
from __future__ import annotations

import torch

from ..spec.placements import Replicate, Shard
from ..errors import LocalTensorError, UnsupportedOpError, user_site
from ..dtensor.factories import upload_replicated, zeros
from ..ops.dispatch import is_strict
from ..dtensor import api
from ..dtensor.tensor import DTensor
from . import functional as F

__all__ = ["rnn_tanh", "rnn_relu", "gru", "lstm", "rnn_tanh_cell", "rnn_relu_cell", "gru_cell", "lstm_cell"]


# --- one time step: (the input's gates, the state) -> the next state --------------------------
# `gates_in` is x W_ih^T + b_ih for this step, computed for all steps at once; `state` is (h,) or
# LSTM's (h, c). Each returns the new state, its first element the step's output.
def _tanh_step(gates_in, state, weight_hh, bias_hh, projection=None):
    return (F.tanh(F.linear(state[0], weight_hh, bias_hh) + gates_in),)


def _relu_step(gates_in, state, weight_hh, bias_hh, projection=None):
    return (F.relu(F.linear(state[0], weight_hh, bias_hh) + gates_in),)


def _gru_step(gates_in, state, weight_hh, bias_hh, projection=None):
    hidden = state[0]
    input_reset, input_update, input_new = gates_in.chunk(3, -1)
    hidden_reset, hidden_update, hidden_new = F.linear(hidden, weight_hh, bias_hh).chunk(3, -1)
    reset = F.sigmoid(hidden_reset + input_reset)
    update = F.sigmoid(hidden_update + input_update)
    new = F.tanh(input_new + hidden_new * reset)
    return ((hidden - new) * update + new,)


def _lstm_step(gates_in, state, weight_hh, bias_hh, projection=None):
    hidden, cell = state
    input_gate, forget_gate, cell_gate, output_gate = (F.linear(hidden, weight_hh, bias_hh) + gates_in).chunk(4, -1)
    cell = F.sigmoid(forget_gate) * cell + F.sigmoid(input_gate) * F.tanh(cell_gate)
    hidden = F.sigmoid(output_gate) * F.tanh(cell)
    return (hidden if projection is None else F.linear(hidden, projection), cell)


# --- whole sequences: torch.rnn_tanh / rnn_relu / gru / lstm --------------------------------------
def _sequence_kernel(name: str, step, states_of, module: str):
    """torch.<name> (torch.nn.<module>'s kernel) on DTensors: (output, *final states).
    states_of turns hx into the tuple of initial state stacks (LSTM's is (h0, c0))."""
    def kernel(input, hx, weights, has_biases, num_layers, dropout, training, bidirectional, batch_first=False):
        _refuse_packed(name, has_biases)
        return _layers(step, input, states_of(hx), weights, has_biases, num_layers, dropout, training,
                       bidirectional, batch_first)
    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = f"torch.{name} on DTensors (torch.nn.{module}'s kernel)."
    return kernel


rnn_tanh = _sequence_kernel("rnn_tanh", _tanh_step, lambda hx: (hx,), "RNN")
rnn_relu = _sequence_kernel("rnn_relu", _relu_step, lambda hx: (hx,), 'RNN(nonlinearity="relu")')
gru = _sequence_kernel("gru", _gru_step, lambda hx: (hx,), "GRU")
lstm = _sequence_kernel("lstm", _lstm_step, tuple, "LSTM, proj_size included")


def _layers(step, input, states, weights, has_biases, num_layers, dropout, training, bidirectional, batch_first):
    """(output, *final states) of `num_layers` stacked layers; `states` holds the initial state
    stacks, each (num_layers * directions, batch, size)."""
    directions = 2 if bidirectional else 1
    time_dim, batch_dim = (1, 0) if batch_first else (0, 1)
    initial = [_on_mesh(state, input, batch_dim, 1).unbind(0) for state in states]
    per_direction = _split_weights(weights, num_layers * directions, has_biases)
    finals = []
    for layer in range(num_layers):
        if layer and dropout and training:   # between layers, as torch: not after the last
            input = F.dropout(input, dropout, True)
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            output, final = _direction(step, input, tuple([s[index] for s in initial]), per_direction[index],
                                       time_dim, reverse=direction == 1)
            outputs.append(output)
            finals.append(final)
        input = outputs[0] if directions == 1 else torch.cat(outputs, -1)
    return (input, *(torch.stack(stack, 0) for stack in zip(*finals)))


def _direction(step, sequence, state, weights, time_dim: int, reverse: bool):
    """One layer in one direction over the whole sequence: (its outputs stacked along time, its
    final state)."""
    weight_ih, weight_hh, bias_ih, bias_hh, projection = weights
    gates_in = F.linear(sequence, weight_ih, bias_ih).unbind(time_dim)   # every step's input share, one op
    outputs = [None] * len(gates_in)
    for time in (reversed(range(len(gates_in))) if reverse else range(len(gates_in))):
        state = step(gates_in[time], state, weight_hh, bias_hh, projection)
        outputs[time] = state[0]
    return torch.stack(outputs, time_dim), state


def _split_weights(weights, groups: int, has_biases: bool) -> list:
    """torch's flat weight list as (weight_ih, weight_hh, bias_ih, bias_hh, projection) per layer
    and direction: each group is w_ih, w_hh, then b_ih, b_hh if has_biases, then LSTM's w_hr if
    proj_size > 0 (which torch tells apart by the count)."""
    if len(weights) % groups:
        raise ValueError(f"recurrent layer: {len(weights)} weights do not split into {groups} layer-directions")
    stride = len(weights) // groups
    split = []
    for start in range(0, len(weights), stride):
        weight_ih, weight_hh, *rest = weights[start:start + stride]
        biases = rest[:2] if has_biases else [None, None]
        projection = rest[2 if has_biases else 0:]
        split.append((weight_ih, weight_hh, *biases, projection[0] if projection else None))
    return split


# --- the cells: torch.rnn_tanh_cell / rnn_relu_cell / gru_cell / lstm_cell ---------------------------
def rnn_tanh_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """torch.rnn_tanh_cell on DTensors (torch.nn.RNNCell's kernel): the next hidden state."""
    return _cell(_tanh_step, input, (hx,), w_ih, w_hh, b_ih, b_hh)[0]


def rnn_relu_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """torch.rnn_relu_cell on DTensors (torch.nn.RNNCell(nonlinearity="relu")'s kernel)."""
    return _cell(_relu_step, input, (hx,), w_ih, w_hh, b_ih, b_hh)[0]


def gru_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """torch.gru_cell on DTensors (torch.nn.GRUCell's kernel): the next hidden state."""
    return _cell(_gru_step, input, (hx,), w_ih, w_hh, b_ih, b_hh)[0]


def lstm_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """torch.lstm_cell on DTensors (torch.nn.LSTMCell's kernel): (h', c')."""
    return _cell(_lstm_step, input, tuple(hx), w_ih, w_hh, b_ih, b_hh)


def _cell(step, input, states, w_ih, w_hh, b_ih, b_hh):
    """One step of a (batch, features) input; the modules pass 2-D states (batch, size)."""
    states = tuple([_on_mesh(state, input, 0, 0) for state in states])
    return step(F.linear(input, w_ih, b_ih), states, w_hh, b_hh)


# --- initial states, and what is refused ------------------------------------------------------------
def _on_mesh(state, input, input_batch_dim: int, state_batch_dim: int):
    """An initial state as a DTensor on the input's mesh. torch's forward makes the default one
    with torch.zeros in this process: a state of zeros is made on the workers instead, its batch
    laid out like the input's (no upload, and strict mode holds). Another torch tensor is
    uploaded Replicate (refused in strict mode, as any local tensor among DTensors)."""
    if isinstance(state, DTensor):
        return state
    mesh = input.device_mesh
    if not state.any():
        placements = [Shard(state_batch_dim) if p.is_shard(input_batch_dim) else Replicate() for p in input.placements]
        return zeros(*state.shape, dtype=state.dtype, device_mesh=mesh, placements=placements)
    if is_strict():
        raise LocalTensorError("recurrent layer: the initial state is a torch tensor of this process "
                               f"(at {user_site()}); in strict mode pass it as a DTensor: "
                               "dtorch.distribute_tensor(hx, mesh, placements)")
    return upload_replicated(state, mesh)


def _refuse_packed(name: str, has_biases) -> None:
    """torch calls the kernel with (input, batch_sizes, hx, weights, has_biases, ...) for a
    PackedSequence: `has_biases` then holds the weight list."""
    if not isinstance(has_biases, bool):
        raise _packed_sequence_error(f"torch.{name} of a PackedSequence")


def _packed_sequence_error(what: str) -> UnsupportedOpError:
    return UnsupportedOpError(
        f"{what} is not supported by dtorch (at {user_site()}): a packed batch interleaves sequences by length, "
        "which no batch shard follows. Pass the padded batch (batch, time, features) instead, and read each "
        "sequence's output at its own last step (output[arange(batch), lengths - 1] with batch_first): exact for "
        "a one-direction layer; a bidirectional one's reverse direction then also reads the padding")


def _refuse_packing(*args, **kwargs):
    raise _packed_sequence_error("torch.nn.utils.rnn.pack_padded_sequence of a DTensor")


api.register_functions(dict(rnn_tanh=rnn_tanh, rnn_relu=rnn_relu, gru=gru, lstm=lstm, rnn_tanh_cell=rnn_tanh_cell,
                            rnn_relu_cell=rnn_relu_cell, gru_cell=gru_cell, lstm_cell=lstm_cell,
                            _pack_padded_sequence=_refuse_packing))
