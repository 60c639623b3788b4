! forkpoint: the Fortran interface to libforkpoint (forkpoint.h), over iso_c_binding.
!
! Every function returns the library's status (FP_OK is 0); fp_errmsg(repo) says what went
! wrong. Arrays of any rank (and scalars) of real(c_float), real(c_double), integer(c_int32_t)
! and integer(c_int64_t) are saved and read whole, or read by box. A Fortran array a(n1, n2)
! is stored as the row-major array of shape [n2, n1], so Python and C see its transpose's
! layout with the same bytes; offsets and box shapes are given here in Fortran order.
module forkpoint
  use, intrinsic :: iso_c_binding
  implicit none
  private

  integer, parameter, public :: FP_OK = 0, FP_ERR_ARG = 1, FP_ERR_IO = 2, FP_ERR_NOT_FOUND = 3, &
       FP_ERR_FORMAT = 4, FP_ERR_NEWER = 5, FP_ERR_CORRUPT = 6, FP_ERR_CONFLICT = 7, FP_ERR_NOMEM = 8, &
       FP_ERR_UNSUPPORTED = 9
  integer, parameter, public :: FP_ID_LEN = 24
  integer(c_int), parameter, public :: FP_CODEC_RAW = 0, FP_CODEC_ZSTD = 1
  ! the dtypes of forkpoint.h these kinds map to
  integer(c_int), parameter :: DT_INT32 = 6, DT_INT64 = 8, DT_FLOAT32 = 11, DT_FLOAT64 = 12
  integer(c_int), parameter :: FP_CREATE = 1

  type, public :: fp_repo
    type(c_ptr) :: p = c_null_ptr
  end type
  type, public :: fp_save
    type(c_ptr) :: p = c_null_ptr
  end type
  type, public :: fp_version
    type(c_ptr) :: p = c_null_ptr
  end type

  public :: fp_open, fp_close, fp_errmsg, fp_save_begin, fp_save_set_step, fp_save_set_message, &
       fp_save_set_metric, fp_save_set_codec, fp_save_put, fp_save_commit, fp_save_abort, fp_load, &
       fp_version_free, fp_version_id, fp_version_step, fp_read, fp_read_box

  interface fp_save_put
    module procedure put_r32, put_r64, put_i32, put_i64
  end interface
  interface fp_read
    module procedure read_r32, read_r64, read_i32, read_i64
  end interface
  interface fp_read_box
    module procedure box_r32, box_r64, box_i32, box_i64
  end interface

  interface
    integer(c_int) function c_open(path, flags, repo) bind(c, name="fp_open")
      import :: c_int, c_char, c_ptr
      character(kind=c_char), intent(in) :: path(*)
      integer(c_int), value :: flags
      type(c_ptr), intent(out) :: repo
    end function
    subroutine c_close(repo) bind(c, name="fp_close")
      import :: c_ptr
      type(c_ptr), value :: repo
    end subroutine
    type(c_ptr) function c_errmsg(repo) bind(c, name="fp_errmsg")
      import :: c_ptr
      type(c_ptr), value :: repo
    end function
    integer(c_size_t) function c_strlen(s) bind(c, name="strlen")
      import :: c_size_t, c_ptr
      type(c_ptr), value :: s
    end function
    integer(c_int) function c_save_begin(repo, branch, save) bind(c, name="fp_save_begin")
      import :: c_int, c_char, c_ptr
      type(c_ptr), value :: repo
      character(kind=c_char), intent(in) :: branch(*)
      type(c_ptr), intent(out) :: save
    end function
    integer(c_int) function c_save_set_step(save, step) bind(c, name="fp_save_set_step")
      import :: c_int, c_ptr, c_int64_t
      type(c_ptr), value :: save
      integer(c_int64_t), value :: step
    end function
    integer(c_int) function c_save_set_message(save, message) bind(c, name="fp_save_set_message")
      import :: c_int, c_char, c_ptr
      type(c_ptr), value :: save
      character(kind=c_char), intent(in) :: message(*)
    end function
    integer(c_int) function c_save_set_metric(save, name, value) bind(c, name="fp_save_set_metric")
      import :: c_int, c_char, c_ptr, c_double
      type(c_ptr), value :: save
      character(kind=c_char), intent(in) :: name(*)
      real(c_double), value :: value
    end function
    integer(c_int) function c_save_set_codec(save, codec) bind(c, name="fp_save_set_codec")
      import :: c_int, c_ptr
      type(c_ptr), value :: save
      integer(c_int), value :: codec
    end function
    integer(c_int) function c_save_put(save, path, dtype, ndim, shape, data) bind(c, name="fp_save_put")
      import :: c_int, c_char, c_ptr, c_int64_t
      type(c_ptr), value :: save
      character(kind=c_char), intent(in) :: path(*)
      integer(c_int), value :: dtype, ndim
      integer(c_int64_t), intent(in) :: shape(*)
      type(c_ptr), value :: data
    end function
    integer(c_int) function c_save_commit(save, id) bind(c, name="fp_save_commit")
      import :: c_int, c_char, c_ptr
      type(c_ptr), value :: save
      character(kind=c_char), intent(out) :: id(*)
    end function
    subroutine c_save_abort(save) bind(c, name="fp_save_abort")
      import :: c_ptr
      type(c_ptr), value :: save
    end subroutine
    integer(c_int) function c_load(repo, ref, version) bind(c, name="fp_load")
      import :: c_int, c_char, c_ptr
      type(c_ptr), value :: repo
      character(kind=c_char), intent(in) :: ref(*)
      type(c_ptr), intent(out) :: version
    end function
    subroutine c_version_free(version) bind(c, name="fp_version_free")
      import :: c_ptr
      type(c_ptr), value :: version
    end subroutine
    type(c_ptr) function c_version_id(version) bind(c, name="fp_version_id")
      import :: c_ptr
      type(c_ptr), value :: version
    end function
    integer(c_int) function c_version_step(version, step) bind(c, name="fp_version_step")
      import :: c_int, c_ptr, c_int64_t
      type(c_ptr), value :: version
      integer(c_int64_t), intent(out) :: step
    end function
    integer(c_int) function c_read_as(version, path, dtype, ndim, shape, buf, bufsize) bind(c, name="fp_read_as")
      import :: c_int, c_char, c_ptr, c_int64_t, c_size_t
      type(c_ptr), value :: version
      character(kind=c_char), intent(in) :: path(*)
      integer(c_int), value :: dtype, ndim
      integer(c_int64_t), intent(in) :: shape(*)
      type(c_ptr), value :: buf
      integer(c_size_t), value :: bufsize
    end function
    integer(c_int) function c_read_box(version, path, ndim, offset, shape, buf, bufsize) bind(c, name="fp_read_box")
      import :: c_int, c_char, c_ptr, c_int64_t, c_size_t
      type(c_ptr), value :: version
      character(kind=c_char), intent(in) :: path(*)
      integer(c_int), value :: ndim
      integer(c_int64_t), intent(in) :: offset(*), shape(*)
      type(c_ptr), value :: buf
      integer(c_size_t), value :: bufsize
    end function
  end interface

contains

  ! ---- repositories ----

  !> Open the repository at `path` (a local directory); create=.true. makes it when absent.
  !> Close it with fp_close whatever the status, so that fp_errmsg can say why it failed.
  integer function fp_open(path, repo, create)
    character(*), intent(in) :: path
    type(fp_repo), intent(out) :: repo
    logical, intent(in), optional :: create
    integer(c_int) :: flags
    flags = 0
    if (present(create)) then
      if (create) flags = FP_CREATE
    end if
    fp_open = c_open(cstr(path), flags, repo%p)
  end function

  subroutine fp_close(repo)
    type(fp_repo), intent(inout) :: repo
    call c_close(repo%p)
    repo%p = c_null_ptr
  end subroutine

  !> The message of the last error on `repo` ("" after success).
  function fp_errmsg(repo) result(msg)
    type(fp_repo), intent(in) :: repo
    character(:), allocatable :: msg
    msg = fstr(c_errmsg(repo%p))
  end function

  ! ---- saving ----

  !> Begin a version on `branch`; its parent is the branch head now.
  integer function fp_save_begin(repo, branch, save)
    type(fp_repo), intent(in) :: repo
    character(*), intent(in) :: branch
    type(fp_save), intent(out) :: save
    fp_save_begin = c_save_begin(repo%p, cstr(branch), save%p)
  end function

  integer function fp_save_set_step(save, step)
    type(fp_save), intent(in) :: save
    integer(c_int64_t), intent(in) :: step
    fp_save_set_step = c_save_set_step(save%p, step)
  end function

  integer function fp_save_set_message(save, message)
    type(fp_save), intent(in) :: save
    character(*), intent(in) :: message
    fp_save_set_message = c_save_set_message(save%p, cstr(message))
  end function

  integer function fp_save_set_metric(save, name, value)
    type(fp_save), intent(in) :: save
    character(*), intent(in) :: name
    real(c_double), intent(in) :: value
    fp_save_set_metric = c_save_set_metric(save%p, cstr(name), value)
  end function

  !> FP_CODEC_RAW (the default) or FP_CODEC_ZSTD for the arrays put after this call.
  integer function fp_save_set_codec(save, codec)
    type(fp_save), intent(in) :: save
    integer(c_int), intent(in) :: codec
    fp_save_set_codec = c_save_set_codec(save%p, codec)
  end function

  !> Write the manifest after every object is durable, then publish the branch record; `id`
  !> (optional, at least FP_ID_LEN characters) gets the new version's id. The save is released.
  integer function fp_save_commit(save, id)
    type(fp_save), intent(inout) :: save
    character(*), intent(out), optional :: id
    character(kind=c_char) :: buf(FP_ID_LEN + 1)
    integer :: i
    buf = c_null_char
    fp_save_commit = c_save_commit(save%p, buf)
    save%p = c_null_ptr
    if (present(id)) then
      id = ""
      do i = 1, min(FP_ID_LEN, len(id))
        if (buf(i) == c_null_char) exit
        id(i:i) = buf(i)
      end do
    end if
  end function

  subroutine fp_save_abort(save)
    type(fp_save), intent(inout) :: save
    call c_save_abort(save%p)
    save%p = c_null_ptr
  end subroutine

  integer function put_any(save, path, dtype, dims, data)
    type(fp_save), intent(in) :: save
    character(*), intent(in) :: path
    integer(c_int), intent(in) :: dtype
    integer, intent(in) :: dims(:)
    type(c_ptr), intent(in) :: data
    integer(c_int64_t) :: shape(max(1, size(dims)))
    shape = 0
    if (size(dims) > 0) shape = reversed(dims)
    put_any = c_save_put(save%p, cstr(path), dtype, int(size(dims), c_int), shape, data)
  end function

  !> Store the whole array `a` (any rank, or a scalar) under `path` ("model/w").
  integer function put_r32(save, path, a)
    type(fp_save), intent(in) :: save
    character(*), intent(in) :: path
    real(c_float), intent(in), target, contiguous :: a(..)
    put_r32 = put_any(save, path, DT_FLOAT32, shape(a), c_loc(a))
  end function
  integer function put_r64(save, path, a)
    type(fp_save), intent(in) :: save
    character(*), intent(in) :: path
    real(c_double), intent(in), target, contiguous :: a(..)
    put_r64 = put_any(save, path, DT_FLOAT64, shape(a), c_loc(a))
  end function
  integer function put_i32(save, path, a)
    type(fp_save), intent(in) :: save
    character(*), intent(in) :: path
    integer(c_int32_t), intent(in), target, contiguous :: a(..)
    put_i32 = put_any(save, path, DT_INT32, shape(a), c_loc(a))
  end function
  integer function put_i64(save, path, a)
    type(fp_save), intent(in) :: save
    character(*), intent(in) :: path
    integer(c_int64_t), intent(in), target, contiguous :: a(..)
    put_i64 = put_any(save, path, DT_INT64, shape(a), c_loc(a))
  end function

  ! ---- loading ----

  !> Open version `ref` (a branch, tag, id or prefix, each optionally with ~N).
  integer function fp_load(repo, ref, version)
    type(fp_repo), intent(in) :: repo
    character(*), intent(in) :: ref
    type(fp_version), intent(out) :: version
    fp_load = c_load(repo%p, cstr(ref), version%p)
  end function

  subroutine fp_version_free(version)
    type(fp_version), intent(inout) :: version
    call c_version_free(version%p)
    version%p = c_null_ptr
  end subroutine

  function fp_version_id(version) result(id)
    type(fp_version), intent(in) :: version
    character(:), allocatable :: id
    id = fstr(c_version_id(version%p))
  end function

  !> .true. and `step` when the version has a step.
  logical function fp_version_step(version, step)
    type(fp_version), intent(in) :: version
    integer(c_int64_t), intent(out) :: step
    step = 0
    fp_version_step = c_version_step(version%p, step) /= 0
  end function

  integer function read_any(version, path, dtype, dims, data, nbytes)
    type(fp_version), intent(in) :: version
    character(*), intent(in) :: path
    integer(c_int), intent(in) :: dtype
    integer, intent(in) :: dims(:)
    type(c_ptr), intent(in) :: data
    integer(c_size_t), intent(in) :: nbytes
    integer(c_int64_t) :: shape(max(1, size(dims)))
    shape = 0
    if (size(dims) > 0) shape = reversed(dims)
    read_any = c_read_as(version%p, cstr(path), dtype, int(size(dims), c_int), shape, data, nbytes)
  end function

  !> Read leaf `path` whole into `a`, which must have its dtype and (Fortran-order) shape;
  !> every byte is checked against its hash.
  integer function read_r32(version, path, a)
    type(fp_version), intent(in) :: version
    character(*), intent(in) :: path
    real(c_float), intent(inout), target, contiguous :: a(..)
    read_r32 = read_any(version, path, DT_FLOAT32, shape(a), c_loc(a), c_sizeof(a))
  end function
  integer function read_r64(version, path, a)
    type(fp_version), intent(in) :: version
    character(*), intent(in) :: path
    real(c_double), intent(inout), target, contiguous :: a(..)
    read_r64 = read_any(version, path, DT_FLOAT64, shape(a), c_loc(a), c_sizeof(a))
  end function
  integer function read_i32(version, path, a)
    type(fp_version), intent(in) :: version
    character(*), intent(in) :: path
    integer(c_int32_t), intent(inout), target, contiguous :: a(..)
    read_i32 = read_any(version, path, DT_INT32, shape(a), c_loc(a), c_sizeof(a))
  end function
  integer function read_i64(version, path, a)
    type(fp_version), intent(in) :: version
    character(*), intent(in) :: path
    integer(c_int64_t), intent(inout), target, contiguous :: a(..)
    read_i64 = read_any(version, path, DT_INT64, shape(a), c_loc(a), c_sizeof(a))
  end function

  integer function box_any(version, path, lower, dims, data, nbytes)
    type(fp_version), intent(in) :: version
    character(*), intent(in) :: path
    integer, intent(in) :: lower(:), dims(:)
    type(c_ptr), intent(in) :: data
    integer(c_size_t), intent(in) :: nbytes
    integer(c_int64_t) :: offset(max(1, size(dims))), shape(max(1, size(dims)))
    offset = 0
    shape = 0
    if (size(lower) /= size(dims)) then
      box_any = FP_ERR_ARG
      return
    end if
    if (size(dims) > 0) then
      offset = reversed(lower - 1)
      shape = reversed(dims)
    end if
    box_any = c_read_box(version%p, cstr(path), int(size(dims), c_int), offset, shape, data, nbytes)
  end function

  !> Read the box of leaf `path` whose first element is at the 1-based index `lower` (one entry
  !> per dimension, Fortran order) and whose shape is a's, into `a`.
  integer function box_r32(version, path, lower, a)
    type(fp_version), intent(in) :: version
    character(*), intent(in) :: path
    integer, intent(in) :: lower(:)
    real(c_float), intent(inout), target, contiguous :: a(..)
    box_r32 = box_any(version, path, lower, shape(a), c_loc(a), c_sizeof(a))
  end function
  integer function box_r64(version, path, lower, a)
    type(fp_version), intent(in) :: version
    character(*), intent(in) :: path
    integer, intent(in) :: lower(:)
    real(c_double), intent(inout), target, contiguous :: a(..)
    box_r64 = box_any(version, path, lower, shape(a), c_loc(a), c_sizeof(a))
  end function
  integer function box_i32(version, path, lower, a)
    type(fp_version), intent(in) :: version
    character(*), intent(in) :: path
    integer, intent(in) :: lower(:)
    integer(c_int32_t), intent(inout), target, contiguous :: a(..)
    box_i32 = box_any(version, path, lower, shape(a), c_loc(a), c_sizeof(a))
  end function
  integer function box_i64(version, path, lower, a)
    type(fp_version), intent(in) :: version
    character(*), intent(in) :: path
    integer, intent(in) :: lower(:)
    integer(c_int64_t), intent(inout), target, contiguous :: a(..)
    box_i64 = box_any(version, path, lower, shape(a), c_loc(a), c_sizeof(a))
  end function

  ! ---- helpers ----

  pure function cstr(s) result(c)
    character(*), intent(in) :: s
    character(kind=c_char, len=len(s) + 1) :: c
    c = s // c_null_char
  end function

  function fstr(p) result(s)
    type(c_ptr), intent(in) :: p
    character(:), allocatable :: s
    character(kind=c_char), pointer :: chars(:)
    integer :: i, n
    if (.not. c_associated(p)) then
      s = ""
      return
    end if
    n = int(c_strlen(p))
    call c_f_pointer(p, chars, [n])
    allocate(character(n) :: s)
    do i = 1, n
      s(i:i) = chars(i)
    end do
  end function

  pure function reversed(dims) result(r)
    integer, intent(in) :: dims(:)
    integer(c_int64_t) :: r(size(dims))
    r = int(dims(size(dims):1:-1), c_int64_t)
  end function
end module forkpoint
