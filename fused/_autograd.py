"""register_autograd: torch.library.register_autograd for a fused:: op, plus the op's eager entry point.

Through the dispatcher, an op whose autograd is registered from Python pays for torch's generic wrapper on every
call (the keyset, the defaults filled back, the redispatch): 45 us more than a torch.autograd.Function running the
same setup_context and backward (fused.rms_norm forward on 8 x 64 floats, a 2-core Zen 3 host: 65 against 20 us),
and an eager GPU training step is bound by that host time at the sizes a transformer layer runs. The entry point
runs eager calls through such a Function; traced calls (torch.compile, fake or functional tensors, torch.func
transforms, tensor subclasses) go through the op itself, which they see as one custom op. Under torch.func's grad,
vjp and jacrev the op's autograd kernel applies that Function too: torch.func refuses the autograd.Function that
torch.library.register_autograd makes (it has no setup_context)."""

import functools
import math

import torch
import torch.autograd.forward_ad as forward_ad
from torch._functorch.autograd_function import enable_single_level_autograd_function

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def check_no_forward_ad(name: str, tensors) -> None:
    """Raises where a call would carry a forward-mode tangent (torch.func.jvp, dual tensors): the fused ops have no
    forward derivatives, and torch would otherwise drop the tangent silently (zero for jvp, None for duals)."""
    stack = torch._C._functorch.get_interpreter_stack() or ()
    jvp = any(i.key() == torch._C._functorch.TransformType.Jvp for i in stack)
    if jvp or (forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)):
        raise NotImplementedError(
            f"fused.{name}: forward-mode AD (torch.func.jvp, forward_ad dual tensors) is not supported; "
            "use reverse mode (backward, torch.func.grad, vjp, jacrev) or the torch reference ops"
        )


FUNC_SECOND_ORDER = (
    "under torch.func: a reverse transform nested in another, or grad / vjp of tensors that require grad outside "
    "them, would differentiate through it; pass detached tensors to torch.func.grad / vjp"
)


def differentiable_outside(tensors) -> bool:
    """Whether a gradient taken outside the torch.func level of a backward's tensors could reach the backward: a
    reverse transform enclosing that level (a finished vjp's level is -2: every active one encloses it), or
    tensors below every transform that require grad."""
    level = max(map(torch._C._functorch.maybe_get_level, tensors))
    level = math.inf if level < 0 else level
    stack = torch._C._functorch.get_interpreter_stack() or ()
    if any(i.key() == torch._C._functorch.TransformType.Grad and i.level() < level for i in stack):
        return True
    for t in tensors:
        while torch._C._functorch.is_functorch_wrapped_tensor(t):
            t = torch._C._functorch.get_unwrapped(t)
        if t.requires_grad:
            return True
    return False


def traced(tensors) -> bool:
    """Whether a call must go through the dispatcher: compiling, torch.jit.trace recording (a Python autograd
    Function would be recorded as a PythonOp, which torch.jit.save cannot export), a functorch transform or a
    dispatch mode active, or a tensor of a subclass other than nn.Parameter (FakeTensor, FunctionalTensor, DTensor)."""
    return (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch._C._len_torch_dispatch_stack() > 0  # a TorchDispatchMode (make_fx, FlopCounterMode, ...)
        or any(type(t) not in _PLAIN for t in tensors)
    )


def first_order(name: str, backward):
    """backward, as it runs under create_graph=True: the fused backward ops have no derivatives of their own, so the
    gradients come out of a node that raises, naming the op, when a second derivative through them is asked for
    (gradient penalties, Hessian-vector products) rather than silently leaving terms out. The node hangs on the
    saved tensors and incoming gradients that require grad, so that autograd.grad(..., inputs=x) reaches it too."""
    message = (
        f"fused.{name}: second derivatives are not supported (its backward ran under create_graph=True and a "
        "gradient of that backward's result was asked for); use the torch reference ops for double backward"
    )

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        # saved_tensors read here only under torch.func: a second read of them fails under non-reentrant checkpointing
        if torch._C._are_functorch_transforms_active():
            tensors = [t for t in (*ctx.saved_tensors, *grads) if isinstance(t, torch.Tensor)]
            if any(map(torch._C._functorch.is_functorch_wrapped_tensor, tensors)):
                # torch.func differentiates with create_graph=True whether or not a second derivative follows
                if differentiable_outside(tensors):
                    raise RuntimeError(f"{message} ({FUNC_SECOND_ORDER})")
                with torch.no_grad():
                    return backward(ctx, *grads)
        if not torch.is_grad_enabled():  # a plain backward: grad mode is on only under create_graph=True
            return backward(ctx, *grads)
        anchors = [
            t.reshape(-1)[:0] for t in (*ctx.saved_tensors, *grads) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        with torch.no_grad():
            result = backward(ctx, *grads)
        outputs = result if isinstance(result, tuple) else (result,)
        tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
        if not tensors:
            return result
        if not anchors:  # nothing to hang the node on: a second derivative could not be told apart from none
            raise RuntimeError(message)
        # leaves that require grad (as torch's once_differentiable passes them) plus the anchors: the node's outputs
        delayed = torch._C._functions.DelayedError(message.encode(), len(tensors) + len(anchors))(
            *(t.detach().requires_grad_() for t in tensors), *anchors
        )
        delayed = iter(delayed[: len(tensors)])
        outputs = tuple(next(delayed) if isinstance(t, torch.Tensor) else t for t in outputs)
        return outputs if isinstance(result, tuple) else outputs[0]

    return wrapper


def register_autograd(name: str, backward, setup_context):
    """Registers backward / setup_context as fused::<name>'s autograd (torch.library.register_autograd's kernel, which
    under torch.func's grad, vjp and jacrev gives way to the Function below) and returns a callable with the op's
    signature. An eager call runs a torch.autograd.Function over the op's kernel below autograd when a gradient is
    wanted, the kernel alone when not; a traced one runs the op, whose registered autograd the dispatcher finds.
    setup_context gets what torch.library gives it: every positional argument (defaults filled in) and, for an op
    with keyword-only arguments, those as keyword_only_inputs."""
    backward = first_order(name, backward)
    op = getattr(torch.ops.fused, name).default
    arguments = op._schema.arguments
    positional = [a for a in arguments if not a.kwarg_only]
    keyword = [(a.name, a.default_value if a.has_default_value() else None) for a in arguments if a.kwarg_only]
    n_args = len(positional)

    def forward(ctx, *flat):
        args, kwargs = flat[:n_args], dict(zip((k for k, _ in keyword), flat[n_args:]))
        with torch._C._AutoDispatchBelowAutograd():
            output = op(*args, **kwargs)
        if keyword:
            setup_context(ctx=ctx, inputs=args, keyword_only_inputs=kwargs, output=output)
        else:
            setup_context(ctx=ctx, inputs=args, output=output)
        return output

    def function_backward(ctx, *grads):
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[:n_args]  # as torch.library's backward sees it: positional inputs only
        try:
            result = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        result = result if isinstance(result, tuple) else (result,)
        return (*result, *(None for _ in keyword))

    # named at creation: autograd names the grad_fn class (fused_<name>_eagerBackward) from it
    Function = type(
        f"fused_{name}_eager",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(function_backward)},
    )

    def function_inputs(args, kwargs):
        if len(args) < n_args:  # the schema's defaults, as torch.library fills them in for setup_context
            args = (*args, *(a.default_value for a in positional[len(args) :]))
        return (*args, *(kwargs.get(k, default) for k, default in keyword))

    def apply_in_func_layer(args, kwargs):
        """Function.apply inside a torch.func layer: a single-level Function, which records on the layer's tensors as
        plain autograd does (Function.apply refuses a Function without setup_context there)."""
        with enable_single_level_autograd_function():
            return super(torch.autograd.Function, Function).apply(*function_inputs(args, kwargs))

    register_autograd_kernel(op, backward, setup_context, apply_in_func_layer)

    def call(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if traced(tensors):
            if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None:
                check_no_forward_ad(name, tensors)
            return op(*args, **kwargs)
        if forward_ad._current_level >= 0:
            check_no_forward_ad(name, tensors)
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            with torch._C._AutoDispatchBelowAutograd():  # no gradient: the kernel, past the autograd wrapper
                return op(*args, **kwargs)
        return Function.apply(*function_inputs(args, kwargs))

    call.__name__ = name
    call.__doc__ = f"torch.ops.fused.{name}, through a torch.autograd.Function when called eagerly with a gradient."
    return call


_LIB = torch.library.Library("fused", "FRAGMENT")


def register_autograd_kernel(op, backward, setup_context, apply_in_func_layer):
    """op's Autograd kernel: torch.library.register_autograd's, except inside a torch.func grad, vjp or jacrev
    layer. There torch's autograd.Function (it has no setup_context) is refused by torch.func, while a Function
    applied as a single-level one records on the layer's tensors as plain autograd does (torch.func's own rule for
    an autograd.Function does the same)."""
    info = torch._library.autograd.Info(backward, setup_context)
    torch_kernel = torch._library.autograd.make_autograd_impl(op, info)

    def kernel(keyset, *args, **kwargs):
        in_func_layer = torch._C._are_functorch_transforms_active()
        if in_func_layer or forward_ad._current_level >= 0:  # torch would drop a tangent silently
            check_no_forward_ad(op._opname, [a for a in args if isinstance(a, torch.Tensor)])
        if in_func_layer and torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return apply_in_func_layer(args, kwargs)
        return torch_kernel(keyset, *args, **kwargs)

    _LIB.impl(op._opname, kernel, "Autograd", with_keyset=True)


def public(name: str, composite):
    """The eager entry point of the composite op fused::<name>: `composite` itself (the code the dispatcher would run
    for torch.ops.fused.<name>, without its round trip into Python, about 4 us a call), or the op through the
    dispatcher while the autograd profiler records eagerly, so that profiles name fused::<name>."""
    op = getattr(torch.ops.fused, name)
    # a private function of torch's: where a torch lacks it, every call takes the dispatcher
    profiling = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)

    def call(*args, **kwargs):
        if not torch.compiler.is_compiling() and profiling():
            return op(*args, **kwargs)
        return composite(*args, **kwargs)

    call.__name__ = name
    return call
