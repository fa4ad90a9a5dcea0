"""torch.nn.RNN / GRU / LSTM and their cells, torch's own modules moved onto a mesh with
dtorch.distribute_module, against the same modules in torch: outputs, final states and
gradients, with the batch sharded over dp (even and uneven) or replicated, in strict mode (so
nothing is gathered or uploaded); a short LSTM training run; dropout; what is refused."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as tnn
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import dtorch
from dtorch import Replicate, Shard

# name -> (module class, constructor options); every one runs on every layout below
_LAYERS = {
    "rnn tanh, 2 layers": (tnn.RNN, dict(num_layers=2)),
    "rnn relu, bidirectional, no bias": (tnn.RNN, dict(nonlinearity="relu", bidirectional=True, bias=False)),
    "gru, 2 layers, bidirectional": (tnn.GRU, dict(num_layers=2, bidirectional=True)),
    "gru, no bias": (tnn.GRU, dict(bias=False)),
    "lstm, 2 layers, bidirectional, proj_size": (tnn.LSTM, dict(num_layers=2, bidirectional=True, proj_size=3)),
    "lstm, no bias": (tnn.LSTM, dict(bias=False)),
}

# name -> (mesh fixture, batch size, the batch's placements on each mesh dim): an uneven batch
# over 4 ranks, an even one over dp of a (2, 2) mesh, and a replicated one
_LAYOUTS = {
    "batch 6 over 4 ranks": ("mesh4", 6, [Shard(0)]),
    "batch 4 over dp of 2x2": ("mesh22", 4, [Shard(0), Replicate()]),
    "replicated": ("mesh4", 3, [Replicate()]),
}

INPUT_SIZE, HIDDEN_SIZE, STEPS = 5, 4, 3


def _batch_laid(placements, batch_dim: int) -> list:
    """The layout's placements with its batch shard moved to `batch_dim`."""
    return [Shard(batch_dim) if p.is_shard() else p for p in placements]


def _sum_of_squares(*tensors):
    """A loss over all of them (P(sum) where the batch is sharded: 0 + P(sum) is refused in
    strict mode, so the sum starts from the first)."""
    total, *rest = [(t * t).sum() for t in tensors]
    for square in rest:
        total = total + square
    return total


def _check_gradients(module, reference, given, expected_inputs):
    for got, want in zip(given, expected_inputs):
        torch.testing.assert_close(got.grad.to_torch(), want.grad, rtol=1e-4, atol=1e-5)
    for (name, got), (_, want) in zip(module.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got.grad.to_torch(), want.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.usefixtures("strict")   # the batch shard stays one, the default state is made on the workers
@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")   # torch's own, CPU
@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("layer", list(_LAYERS))
def test_recurrent_layers_equal_torch(layer, layout, request):
    """Each layer on each layout, batch_first for LSTM and sequence-first otherwise, the initial
    state given (a DTensor, its batch laid like the input's) for the bidirectional ones and the
    default zeros otherwise: the output, the final states and the gradients of the input, the
    given state and every parameter (after a loss over all of them) equal torch's."""
    cls, options = _LAYERS[layer]
    mesh_name, batch, placements = _LAYOUTS[layout]
    mesh = request.getfixturevalue(mesh_name)
    batch_first = cls is tnn.LSTM
    torch.manual_seed(len(layer))
    reference = cls(INPUT_SIZE, HIDDEN_SIZE, batch_first=batch_first, **options)
    module = dtorch.distribute_module(copy.deepcopy(reference), mesh)
    x = torch.randn(batch, STEPS, INPUT_SIZE) if batch_first else torch.randn(STEPS, batch, INPUT_SIZE)
    states = _initial_states(reference, batch) if options.get("bidirectional") else ()
    expected_inputs = [t.clone().requires_grad_() for t in (x, *states)]
    given = [dtorch.distribute_tensor(x, mesh, _batch_laid(placements, 0 if batch_first else 1)).requires_grad_()]
    given += [dtorch.distribute_tensor(t, mesh, _batch_laid(placements, 1)).requires_grad_() for t in states]
    expected_output, expected_final = reference(expected_inputs[0], *_as_hx(expected_inputs[1:]))
    output, final = module(given[0], *_as_hx(given[1:]))
    expected_final, final = (_as_tuple(f) for f in (expected_final, final))
    torch.testing.assert_close(output.to_torch(), expected_output.detach(), rtol=1e-5, atol=1e-6)
    assert output.placements == tuple(given[0].placements)
    for got, want in zip(final, expected_final):
        torch.testing.assert_close(got.to_torch(), want.detach(), rtol=1e-5, atol=1e-6)
        assert got.placements == tuple(_batch_laid(placements, 1))
    _sum_of_squares(expected_output, *expected_final).backward()
    _sum_of_squares(output, *final).backward()
    _check_gradients(module, reference, given, expected_inputs)


def _initial_states(reference, batch: int) -> tuple:
    """Random (h_0,) or LSTM's (h_0, c_0), the shapes the layer expects."""
    count = reference.num_layers * (2 if reference.bidirectional else 1)
    hidden = torch.randn(count, batch, reference.proj_size or reference.hidden_size)
    return (hidden, torch.randn(count, batch, reference.hidden_size)) if isinstance(reference, tnn.LSTM) else (hidden,)


def _as_hx(states) -> tuple:
    """The call's optional hx argument: nothing, h_0, or LSTM's (h_0, c_0)."""
    return () if not states else (states[0],) if len(states) == 1 else (tuple(states),)


def _as_tuple(final) -> tuple:
    return tuple(final) if isinstance(final, tuple) else (final,)


@pytest.mark.usefixtures("strict")
@pytest.mark.parametrize("cls", [tnn.RNNCell, tnn.GRUCell, tnn.LSTMCell], ids=lambda cls: cls.__name__)
def test_cells_unrolled_equal_torch(cls, mesh4):
    """torch's cells unrolled over 3 steps by hand (the first with the default zero state) on a
    batch of 6 over 4 ranks: every step's state and the gradients equal torch's."""
    torch.manual_seed(20)
    reference = cls(INPUT_SIZE, HIDDEN_SIZE)
    cell = dtorch.distribute_module(copy.deepcopy(reference), mesh4)
    x = torch.randn(STEPS, 6, INPUT_SIZE)
    expected_input = x.clone().requires_grad_()
    given = dtorch.distribute_tensor(x, mesh4, [Shard(1)]).requires_grad_()
    expected_state = state = None
    expected_states, states = [], []
    for step in range(STEPS):
        expected_state = reference(expected_input[step], expected_state)
        state = cell(given[step], state)
        for got, want in zip(_as_tuple(state), _as_tuple(expected_state)):
            torch.testing.assert_close(got.to_torch(), want.detach(), rtol=1e-5, atol=1e-6)
        expected_states += _as_tuple(expected_state)
        states += _as_tuple(state)
    _sum_of_squares(*expected_states).backward()
    _sum_of_squares(*states).backward()
    _check_gradients(cell, reference, [given], [expected_input])


def test_unbatched_input_equals_torch(mesh4):
    """A 2-D input (torch's forward adds the batch dim of 1 and removes it after), replicated:
    a 2-layer GRU's output and final state, and an LSTMCell's (h, c), equal torch's."""
    torch.manual_seed(24)
    layer, cell = tnn.GRU(INPUT_SIZE, HIDDEN_SIZE, num_layers=2), tnn.LSTMCell(INPUT_SIZE, HIDDEN_SIZE)
    x = torch.randn(STEPS, INPUT_SIZE)
    given = dtorch.distribute_tensor(x, mesh4, [Replicate()])
    for reference, value, expected in ((layer, given, layer(x)), (cell, given[0], cell(x[0]))):
        got = dtorch.distribute_module(copy.deepcopy(reference), mesh4)(value)
        for result, want in zip(got, expected):
            torch.testing.assert_close(result.to_torch(), want.detach(), rtol=1e-5, atol=1e-6)


class _Tagger(tnn.Module):
    """A torch sequence model: embedding, a 2-layer LSTM, a linear head per step."""

    def __init__(self, vocab: int = 11, hidden: int = 8, dropout: float = 0.0):
        super().__init__()
        self.embed = tnn.Embedding(vocab, hidden)
        self.lstm = tnn.LSTM(hidden, hidden, num_layers=2, batch_first=True, dropout=dropout)
        self.head = tnn.Linear(hidden, vocab)

    def forward(self, ids):
        return self.head(self.lstm(self.embed(ids))[0])


def test_an_lstm_model_trains_as_torch_does(mesh22):
    """3 AdamW steps of next-token cross-entropy on a batch of 6 over dp of a (2, 2) mesh: every
    loss and the final parameters equal torch's."""
    torch.manual_seed(21)
    reference = _Tagger()
    model = dtorch.distribute_module(copy.deepcopy(reference), mesh22)
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(22)
    for ids in [torch.randint(0, 11, (6, 5), generator=g) for _ in range(3)]:
        inputs, targets = ids[:, :-1], ids[:, 1:]
        loss = F.cross_entropy(model(dtorch.distribute_tensor(inputs, mesh22, [Shard(0), Replicate()])).flatten(0, 1),
                               dtorch.distribute_tensor(targets.flatten(), mesh22, [Shard(0), Replicate()]))
        expected = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
        for optimizer, value in ((opt, loss), (reference_opt, expected)):
            value.backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(loss.item(), expected.item(), rtol=2e-4, atol=0)
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got.to_torch(), want.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_a_compiled_lstm_step_equals_torch(mesh4):
    """dtorch.compile captures a whole step (the LSTM's dozens of per-step ops, its backward and
    AdamW; from the third call one command): 4 steps' losses equal torch's."""
    torch.manual_seed(25)
    reference = tnn.LSTM(INPUT_SIZE, HIDDEN_SIZE, num_layers=2, batch_first=True)
    module = dtorch.distribute_module(copy.deepcopy(reference), mesh4)
    opt = dtorch.optim.AdamW(module.parameters(), lr=1e-2)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    @dtorch.compile
    def step(x):
        loss = module(x)[0].pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x = torch.randn(6, STEPS, INPUT_SIZE)
    given = dtorch.distribute_tensor(x, mesh4, [Shard(0)])
    for _ in range(4):
        loss = step(given)
        expected = reference(x)[0].pow(2).mean()
        expected.backward()
        reference_opt.step()
        reference_opt.zero_grad()
        torch.testing.assert_close(loss.item(), expected.item(), rtol=2e-4, atol=0)
    assert step.captures == 2   # the first call made AdamW's state; replays from then on


def test_dropout_between_layers_only_in_training(mesh4):
    """With dropout=0.5 between the LSTM's layers: in training the output changes with the
    draws and repeats with dtorch's seed; in eval it equals torch's eval output."""
    torch.manual_seed(23)
    reference = _Tagger(dropout=0.5)
    model = dtorch.distribute_module(copy.deepcopy(reference), mesh4)
    ids = torch.randint(0, 11, (6, 5))
    given = dtorch.distribute_tensor(ids, mesh4, [Shard(0)])
    outputs = []
    for seed in (1, 1, 2):
        dtorch.manual_seed(seed)
        outputs.append(model(given).to_torch())
    assert torch.equal(outputs[0], outputs[1]) and not torch.allclose(outputs[0], outputs[2])
    model.eval()
    reference.eval()
    torch.testing.assert_close(model(given).to_torch(), reference(ids).detach(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(outputs[0], reference(ids))


def test_what_recurrent_layers_refuse_says_what_to_do(mesh4, strict):
    """A PackedSequence (pack_padded_sequence of a DTensor, or one built around a DTensor) is
    refused at the user's line with the padded alternative; in strict mode, so is an initial
    state held in this process (unless it is zeros, which is made on the workers)."""
    gru = dtorch.distribute_module(tnn.GRU(INPUT_SIZE, HIDDEN_SIZE, batch_first=True), mesh4)
    x = dtorch.randn(4, STEPS, INPUT_SIZE, device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(dtorch.UnsupportedOpError, match="pack_padded_sequence of a DTensor.*test_recurrent.py.*padded"):
        pack_padded_sequence(x, [3, 3, 2, 1], batch_first=True)
    packed = PackedSequence(dtorch.randn(9, INPUT_SIZE, device_mesh=mesh4), torch.tensor([4, 3, 2]))
    with pytest.raises(dtorch.UnsupportedOpError, match="torch.gru of a PackedSequence.*test_recurrent.py.*padded"):
        gru(packed)
    with pytest.raises(dtorch.LocalTensorError, match="initial state.*test_recurrent.py.*distribute_tensor"):
        gru(x, torch.ones(1, 4, HIDDEN_SIZE))
    assert gru(x, torch.zeros(1, 4, HIDDEN_SIZE))[1].placements == (Shard(1),)
