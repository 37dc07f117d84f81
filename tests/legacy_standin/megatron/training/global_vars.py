"""Stand-in for megatron/training/global_vars.py (core_v0.16.1)."""
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator, unset_num_microbatches_calculator

_GLOBAL_ARGS = None
_GLOBAL_TOKENIZER = None
_GLOBAL_TENSORBOARD_WRITER = None
_GLOBAL_WANDB_WRITER = None


def get_args():
    """Return arguments."""
    _ensure_var_is_initialized(_GLOBAL_ARGS, 'args')
    return _GLOBAL_ARGS


def get_tensorboard_writer():
    return _GLOBAL_TENSORBOARD_WRITER


def get_wandb_writer():
    return _GLOBAL_WANDB_WRITER


def set_global_variables(args, build_tokenizer=True):
    """Set args, tokenizer, tensorboard-writer, adlr-autoresume, and timers."""
    assert args is not None
    _ensure_var_is_not_initialized(_GLOBAL_ARGS, 'args')
    set_args(args)
    init_num_microbatches_calculator(
        args.rank,
        args.rampup_batch_size,
        args.global_batch_size,
        args.micro_batch_size,
        args.data_parallel_size,
        args.decrease_batch_size_if_needed,
    )
    if build_tokenizer:
        _build_tokenizer(args)


def set_args(args):
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def _vocab_size_with_padding(orig_vocab_size, args):
    after = orig_vocab_size
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    after = int((after + multiple - 1) // multiple * multiple)
    return after


def _build_tokenizer(args):
    """The vocabulary padding of build_tokenizer (NullTokenizer counted one extra EOD token up to 0.17)."""
    global _GLOBAL_TOKENIZER
    _ensure_var_is_not_initialized(_GLOBAL_TOKENIZER, 'tokenizer')
    if args.tokenizer_type == 'NullTokenizer':
        vocab = args.vocab_size + 1
    elif args.tokenizer_type == 'GPT2BPETokenizer':
        vocab = 50257
    else:
        raise NotImplementedError(f'stand-in tokenizer {args.tokenizer_type}')
    _GLOBAL_TOKENIZER = object()
    args.padded_vocab_size = _vocab_size_with_padding(vocab, args)
    return _GLOBAL_TOKENIZER


def unset_global_variables():
    global _GLOBAL_ARGS, _GLOBAL_TOKENIZER, _GLOBAL_TENSORBOARD_WRITER, _GLOBAL_WANDB_WRITER
    _GLOBAL_ARGS = None
    _GLOBAL_TOKENIZER = None
    _GLOBAL_TENSORBOARD_WRITER = None
    _GLOBAL_WANDB_WRITER = None
    unset_num_microbatches_calculator()


def _ensure_var_is_initialized(var, name):
    assert var is not None, '{} is not initialized.'.format(name)


def _ensure_var_is_not_initialized(var, name):
    assert var is None, '{} is already initialized.'.format(name)
