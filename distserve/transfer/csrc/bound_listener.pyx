# distutils: language = c++
# cython: language_level=3
"""A ucxx listener bound to one address: ucxx 0.52's Python API takes a port only and binds every
interface, while its C++ ListenerBuilder has host(). This builds the same UCXListener object that
ucxx's UCXListener.create returns (so ucxx._lib_async.Listener wraps it as usual), through
ListenerBuilder(...).host(host). Built on first use by distserve.transfer.bound_listener."""

import weakref

from libc.stdint cimport uint16_t, uintptr_t
from libcpp.memory cimport shared_ptr
from libcpp.string cimport string

from ucxx._lib.libucxx cimport UCXEndpoint, UCXListener, UCXWorker
from ucxx._lib.ucxx_api cimport Listener, Worker, ucp_conn_request_h, ucp_listener_conn_callback_t


cdef extern from "ucxx/listener_builder.h" namespace "ucxx" nogil:
    cdef cppclass HostListenerBuilder "ucxx::ListenerBuilder":
        HostListenerBuilder(shared_ptr[Worker] worker, uint16_t port,
                            ucp_listener_conn_callback_t callback, void* callback_args) except +
        HostListenerBuilder& host(string host) except +
        shared_ptr[Listener] build() except +


cdef void _on_connection(ucp_conn_request_h conn_request, void* args) noexcept with gil:
    # Runs on ucxx's progress thread, as ucxx's own listener callback does: make the endpoint, then
    # hand it to cb_func (which schedules the rest on the event loop).
    cdef dict callback = <dict>args
    try:
        listener = callback["listener"]()
        if listener is None:  # closing: UCX rejects the request when the listener is destroyed
            return
        endpoint = UCXEndpoint.create_from_conn_request(listener, <uintptr_t>conn_request, True)
        callback["cb_func"](endpoint, *callback["cb_args"])
    except BaseException as exc:  # an exception cannot cross into UCX's C callback
        callback["on_error"](exc)


def create_listener(UCXWorker worker, str host, uint16_t port, cb_func, tuple cb_args, on_error):
    """A UCXListener on host:port (port 0: any free one). cb_func(endpoint, *cb_args) gets each new
    connection's UCXEndpoint, as with UCXListener.create(..., deliver_endpoint=True); on_error(exc) gets
    what cb_func or the endpoint's creation raised."""
    cdef UCXListener listener = UCXListener.__new__(UCXListener)
    # The listener keeps this dict (and so the callback's argument) alive for as long as it listens.
    cdef dict callback = {"cb_func": cb_func, "cb_args": cb_args, "on_error": on_error,
                          "listener": weakref.ref(listener)}
    listener._cb_data = callback
    # As ucxx's own listener: the endpoints it makes wait on Python futures like the worker's, where
    # False would make every wait a busy poll (await asyncio.sleep(0)) on an idle pooled endpoint.
    listener._enable_python_future = worker._enable_python_future
    cdef string c_host = host.encode()
    cdef HostListenerBuilder* builder = new HostListenerBuilder(
        worker.get_ucxx_shared_ptr(), port, _on_connection, <void*>callback)
    try:
        builder.host(c_host)
        listener._listener = builder.build()
    finally:
        del builder
    return listener
